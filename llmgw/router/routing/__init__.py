"""
The router's routing: which replica a request goes to (C{balancer},
C{load}, C{affinity}, C{ejection}, C{speed}, C{decision}, C{adapters}) and
where it waits first (C{activation}, C{overload}, in the order of
C{fairness}).  It imports the upstream and telemetry rooms
(docs/architecture.md, "The router's rooms").
"""
