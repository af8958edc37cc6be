"""
The HTTP connection pool the agent uses for its engines' health URLs.

It imports nothing else from llmgw than L{llmgw.twisted_private}, where
the private Twisted names it uses are listed.
"""

from __future__ import annotations

from twisted.web.client import HTTPConnectionPool

from llmgw.twisted_private import HTTP11ClientFactory


class _QuietFactory(HTTP11ClientFactory):
    # Twisted logs a start and a stop line per connection's factory
    # otherwise: two lines per new engine connection and health probe.
    noisy = False


class QuietConnectionPool(HTTPConnectionPool):
    """
    An L{HTTPConnectionPool} that does not log each connection.
    """

    _factory = _QuietFactory
