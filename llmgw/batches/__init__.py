"""
Files and batches: the C{[batches]} settings and the router's
L{llmgw.router.batch_interfaces} (C{FileStore}, C{BatchStore}) on the store
(docs/batches.md).
"""
