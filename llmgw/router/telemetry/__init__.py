"""
The router's telemetry: traffic metrics and the registry every C{/metrics}
serves (C{metrics}), the OpenTelemetry spans of each request (C{tracing})
and their way out to a collector (C{export}).  It imports no other room
(docs/architecture.md, "The router's rooms").
"""
