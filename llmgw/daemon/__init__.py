"""
What every llmgw daemon's C{tap.py} shares: the named stop sequence
(L{llmgw.daemon.lifecycle}), listeners from endpoint strings, the JSON
log, and the open-file limit.  Knows no routing, placement or store.
"""
