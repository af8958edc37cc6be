"""
The process's open-file limit: every client connection holds a file
descriptor, and the usual soft limit (1024 on many Linux systems) is far
below what the router's connection caps allow.
"""

from __future__ import annotations

import resource

from twisted.logger import Logger

log = Logger()

# What the kernel accepts when the hard limit is "unlimited" (Linux's
# default fs.nr_open).
_UNLIMITED_TARGET = 1024 * 1024

# Descriptors kept back from client connections: listeners, engines' and
# agents' connections, the store, logs.
RESERVE = 256


def raise_open_file_limit(max_connections: int) -> int:
    """
    Raise the soft C{RLIMIT_NOFILE} to the hard limit, and log the outcome
    (one line); warn when C{max_connections} cannot all be open at once.

    @param max_connections: the router's cap on client connections, 0 for
        none.
    @return: the soft limit now in force, in descriptors.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            log.warn(
                "open-file limit stays {soft}: cannot raise it to {target}: {error}",
                soft=soft,
                target=target,
                error=str(e),
            )
        else:
            log.info(
                "open-file limit raised from {soft} to {target}",
                soft=soft,
                target=target,
            )
            soft = target
    else:
        log.info("open-file limit {soft}", soft=soft)
    if soft != resource.RLIM_INFINITY and max_connections + RESERVE > soft:
        log.warn(
            "router.max_connections is {cap} but the open-file limit is {soft}:"
            " connections past {usable} fail to be accepted",
            cap=max_connections or "unlimited",
            soft=soft,
            usable=max(soft - RESERVE, 0),
        )
    return int(soft)
