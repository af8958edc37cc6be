"""
The tier's setting in the server's configuration: C{router_workers}, the
C{llmgw-router} children L{llmgw.tier.workers} supervises (the top-level
key and the C{--router-workers} flag), declared with its kind
(L{ROUTER_WORKERS}) for the file and the flag alike.  Imports only
L{llmgw.config_checks}.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.config_checks import Integer

MAX_ROUTER_WORKERS = 64


@dataclass(frozen=True)
class Workers(Integer):
    """
    A whole number of workers, or its digits as a string (as the
    C{--router-workers} flag gives it).
    """

    def read(self, where: str, value: object) -> int:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        return super().read(where, value)


ROUTER_WORKERS = Workers(0, MAX_ROUTER_WORKERS)
"""
The kind of C{router_workers}: 0 to L{MAX_ROUTER_WORKERS}.
"""


def check_router_workers(value: object) -> int:
    """
    @return: C{router_workers}, a whole number from 0 to L{MAX_ROUTER_WORKERS}.
    @raise ConfigError: it is not.
    """
    return ROUTER_WORKERS.read("router_workers", value)
