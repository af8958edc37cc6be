"""
twistd plugins: C{twistd llmgw-server}, C{twistd llmgw-router} and
C{twistd llmgw-agent}.
"""

from twisted.application.service import ServiceMaker

llmgw_server = ServiceMaker(
    "llmgw server",
    "llmgw.server.tap",
    "llmgw router: one OpenAI-compatible endpoint in front of engine replicas",
    "llmgw-server",
)

llmgw_agent = ServiceMaker(
    "llmgw agent",
    "llmgw.agent.tap",
    "llmgw node agent: dials the server, reports this node, runs engines",
    "llmgw-agent",
)

llmgw_router = ServiceMaker(
    "llmgw router",
    "llmgw.tier.tap",
    "llmgw router tier: the client API, following an llmgw-server's admin API",
    "llmgw-router",
)
