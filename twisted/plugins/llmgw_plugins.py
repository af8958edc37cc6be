"""
twistd plugins: C{twistd llmgw-server} and C{twistd llmgw-agent}.
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
