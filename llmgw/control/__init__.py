"""
The control plane (docs/architecture.md, "The control loop"), in the server
process.

Policy, pure (no clock, no I/O): C{catalog} (the C{[[models]]} tables),
C{placement} (where a replica fits), C{scaling} (how many replicas a
model wants), C{adoption} (what a Register's shards become).  State:
C{inventory} (nodes, as their agents describe them), C{records} (replicas
and shards, with their states), C{runtime} (the catalog at run time and
the router's side: activation), C{snapshot} (the inventory as placement
sees it).  I/O: C{agents} (the server's end of the agent links),
C{commands} (shard commands to agents), C{weights} (finding and deleting
unused model files).  C{plane} runs the reconciler pass on C{loop};
C{views} shows it all to the admin API.
"""
