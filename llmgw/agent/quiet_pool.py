"""
The HTTP connection pool the agent uses for its engines' health URLs.

A leaf: it imports nothing from the rest of llmgw.
"""

from __future__ import annotations

from twisted.web.client import HTTPConnectionPool, _HTTP11ClientFactory


class _QuietFactory(_HTTP11ClientFactory):
    # Twisted logs a start and a stop line per connection's factory
    # otherwise: two lines per new engine connection and health probe.
    noisy = False


class QuietConnectionPool(HTTPConnectionPool):
    """
    An L{HTTPConnectionPool} that does not log each connection.
    """

    _factory = _QuietFactory
