"""
API keys and usage records between the router and the store, for every
process that serves clients (the server and the routers of a tier): key
changes shared through PostgreSQL (L{llmgw.accounts.keysync}) and the
router's usage records written to the store (L{llmgw.accounts.usage}).
"""
