"""
The router's upstream, the engines' side of an exchange: what it needs of a
client (C{base}), the engine client and its HTTP/1.1 connections
(C{engine_client}, C{http1}), the answer's parser (C{response_parser},
C{response_head}), the C{/metrics} client (C{scrape}), the stream read back
(C{sse}, C{relay}) and its deadlines and backpressure (C{deadlines},
C{backpressure}).  It imports no other room (docs/architecture.md, "The
router's rooms").
"""
