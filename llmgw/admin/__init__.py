"""
The admin API on the admin listener: C{/api/v1} (L{llmgw.admin.api}), who
may use it (L{llmgw.admin.guard}), the keys and usage routes, the routes a
router tier follows, and the metrics-only listener.  The server wires it;
it reads the control plane and the store.
"""
