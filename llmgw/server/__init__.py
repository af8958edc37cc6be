"""
C{twistd llmgw-server}: the server process's wiring (L{llmgw.server.tap}),
leadership among standbys (L{llmgw.server.standby}), C{--local}
(L{llmgw.server.local}) and the engines' secrets.
"""
