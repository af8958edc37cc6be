"""
Files and batches (docs/batches.md).
"""
