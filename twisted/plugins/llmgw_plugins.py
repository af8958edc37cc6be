"""
twistd plugins: C{twistd llmgw-server}.
"""

from twisted.application.service import ServiceMaker

llmgw_server = ServiceMaker(
    "llmgw server",
    "llmgw.server.tap",
    "llmgw router: one OpenAI-compatible endpoint in front of engine replicas",
    "llmgw-server",
)
