"""
llmgw: one OpenAI-compatible endpoint in front of a fleet of GPU nodes.
"""

__version__ = "0.1.0"
