"""
The store (docs/keys.md): API keys, usage records and runtime
models in SQLite (L{llmgw.store.db}) or PostgreSQL (L{llmgw.store.pg}), every
query on a thread pool off the reactor thread.
"""
