"""
The router's API: the OpenAI and Anthropic routes (C{app}, C{fastpath}),
the body prepared and translated (C{prepare}, C{anthropic},
C{anthropic_stream}), and one request's trip to the replicas and back
(C{exchange}, its waits in C{waiting}, what every exchange shares in
C{services}, its record in C{records}).  The top room: it imports the
edge, routing, upstream and telemetry rooms, and none imports it
(docs/architecture.md, "The router's rooms").
"""
