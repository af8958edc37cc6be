"""
The router's accounting: API keys and their limits (C{auth}), the same
limits counted in Redis (C{limits}) and where each finished request's
record goes (C{usage_log}).  It imports the routing room for a key's
priority (docs/architecture.md, "The router's rooms").
"""
