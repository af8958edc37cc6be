"""
The HTTP connection pool the router (to replicas) and the agent (to its
engines' health URLs) both use.

A leaf: it imports nothing from the rest of llmgw, so the agent uses it
without importing the router.
"""

from __future__ import annotations

from typing import Any

from twisted.web.client import HTTPConnectionPool, _HTTP11ClientFactory


class _QuietFactory(_HTTP11ClientFactory):
    # Twisted logs a start and a stop line per connection's factory
    # otherwise: two lines per new engine connection and health probe.
    noisy = False


class QuietConnectionPool(HTTPConnectionPool):
    """
    An L{HTTPConnectionPool} that does not log each connection, and says
    whether the connection it handed out last was reused.

    @ivar last_reused: whether the last L{getConnection} gave an idle
        connection from the pool (it may have been closed by the engine
        meanwhile) rather than a new one.
    """

    _factory = _QuietFactory
    last_reused = False

    def getConnection(self, key: Any, endpoint: Any) -> Any:
        result = super().getConnection(key, endpoint)
        # A pooled connection comes in a Deferred that has fired already; a
        # new one waits for its TCP handshake.
        self.last_reused = bool(result.called)
        return result
