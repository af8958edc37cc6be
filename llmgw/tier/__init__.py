"""
A tier of routers (issue 12 item 2): C{twistd llmgw-router} follows a
control plane's endpoints and catalog through its admin API's watch and
forwards activations to it.
"""
