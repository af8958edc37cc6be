"""
The store (DESIGN.md section 6): API keys, usage records and runtime
models in SQLite, every query on a thread pool off the reactor thread.
"""
