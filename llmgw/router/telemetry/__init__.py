"""
The router's telemetry: traffic metrics and the registry every C{/metrics}
serves (C{metrics}), and the OpenTelemetry spans of each request
(C{tracing}).  It imports no other room (docs/architecture.md, "The
router's rooms").
"""
