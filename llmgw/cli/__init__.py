"""
The C{llmgw} console script: C{ctl} (the admin API's client), C{certs} (the
fleet CA and certificates) and C{sim} (the engine simulator).
"""
