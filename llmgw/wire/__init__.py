"""
The wire between agent and server: framing, messages, TLS options, and
the shard state names both processes use (L{llmgw.wire.states}).  Knows
no policy; C{llmgw/control} and C{llmgw/agent} meet only here.
"""
