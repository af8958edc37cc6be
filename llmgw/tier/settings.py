"""
The tier's setting in the server's configuration: C{router_workers}, the
C{llmgw-router} children L{llmgw.tier.workers} supervises (the top-level
key and the C{--router-workers} flag).  Imports only
L{llmgw.config_checks}.
"""

from __future__ import annotations

from llmgw.config_checks import ConfigError

MAX_ROUTER_WORKERS = 64


def check_router_workers(value: object) -> int:
    """
    @return: C{router_workers}, a whole number from 0 to L{MAX_ROUTER_WORKERS}.
    @raise ConfigError: it is not.
    """
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not 0 <= value <= MAX_ROUTER_WORKERS
    ):
        raise ConfigError(
            f"router_workers: expected a whole number from 0 to {MAX_ROUTER_WORKERS},"
            f" got {value!r}"
        )
    return value
