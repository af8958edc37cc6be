"""
The dashboard: server-rendered pages over the fleet, on the admin
listener and behind a login at C{/admin} on the client listener; and the
admin listener's profiling pages.
"""
