"""
The wire between agent and server: framing, messages, TLS options.  Knows no
policy; C{llmgw/control} and C{llmgw/agent} meet only here.
"""
