"""
Opening a listener from a Twisted endpoint string at start, for the
server and the router.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IReactorTCP
from twisted.python.failure import Failure

from llmgw.config_checks import ConfigError


class ListenError(ConfigError):
    """
    A listener that cannot open: its address is in use or not permitted.
    Not a mistake in the configuration's text, so a start ends with its
    own exit status (1; docs/server.md, "Exit statuses").
    """


def listen(
    reactor: IReactorTCP, key: str, description: str, factory: Any
) -> IListeningPort:
    """
    Listen now, so that a port in use or a bad endpoint string ends the
    process with one line at start instead of a logged failure in a
    process that serves nothing.

    @raise ListenError: the address is taken or not permitted.
    @raise ConfigError: a bad endpoint string.
    """
    kind = description.split(":", 1)[0]
    if kind in ("tcp", "ssl", "tcp6", "unix") and "backlog=" not in description:
        # Twisted's default backlog of 50 drops connections in a burst of a
        # few hundred clients opening at once (seen with 200 concurrent
        # openai clients); the kernel caps it at net.core.somaxconn anyway.
        description += ":backlog=1024"
    try:
        endpoint = serverFromString(reactor, description)
    except Exception as e:
        raise ConfigError(f"{key}: bad endpoint {description!r}: {e}") from None
    results: list[Any] = []
    endpoint.listen(factory).addBoth(results.append)
    if not results:
        raise ConfigError(
            f"{key}: endpoint {description!r} does not listen at once;"
            " use tcp:, ssl: or unix:"
        )
    result = results[0]
    if isinstance(result, Failure):
        raise ListenError(
            f"{key}: cannot listen on {description!r}: {result.getErrorMessage()}"
        )
    return result  # type: ignore[no-any-return]
