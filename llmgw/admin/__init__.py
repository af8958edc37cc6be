"""
The admin API on the admin listener: C{/api/v1} (L{llmgw.admin.api}, which
composes the route groups, each with its own Klein app), who may use it
(L{llmgw.admin.guard}), and the metrics-only listener.  The server wires
it; it reads the control plane and the store.
"""
