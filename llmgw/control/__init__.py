"""
The control plane: inventory of nodes and the agent links (more to come:
catalog, placement, reconciler).
"""
