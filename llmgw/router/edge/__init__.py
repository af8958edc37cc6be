"""
The router's edge, where a client's request comes in: the connections and
their caps, HTTP/1.1 and HTTP/2 (C{connections}), an HTTP/1.1 connection's
bounds (C{channel}), the site with its body limit and request ids
(C{site}), the CORS policy (C{cors}) and the C{Server-Timing} header
(C{timing}).  It imports no other room (docs/architecture.md, "The
router's rooms").
"""
