"""
Files and batches: the C{[batches]} settings and the router's
L{llmgw.router.batch_interfaces} (C{FileStore}, C{BatchStore}) on the store
(docs/batches.md); the runner that sends the lines, and C{room}, how many
lines a model may take beside its interactive traffic (the router's
L{llmgw.router.interfaces.BatchRoom}).
"""
