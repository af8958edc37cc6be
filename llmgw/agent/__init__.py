"""
The node agent: dials the server, reports the node, runs engines.
"""
