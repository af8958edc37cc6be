"""
Batch work on the fleet (docs/batches.md): OpenAI's Files and Batches APIs
and Anthropic's Message Batches, their lines run on what the fleet leaves
idle.  Here so far: C{room}, how many lines a model may take beside its
interactive traffic (the router's L{llmgw.router.interfaces.BatchRoom}),
and C{settings}, the C{[batches]} table.
"""
