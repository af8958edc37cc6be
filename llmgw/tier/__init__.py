"""
A tier of routers (issue 12 item 2), both ends of it: C{twistd llmgw-router}
(L{llmgw.tier.tap}) follows a control plane's endpoints and catalog through
its admin API's watch (L{llmgw.tier.watch}, the format both ends share),
through the admin API's client (L{llmgw.tier.admin_client}), and forwards
activations to it; C{llmgw-server --router-workers N} supervises N of them
(L{llmgw.tier.workers}).
"""
