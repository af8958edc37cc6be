"""
Every private name of Twisted that llmgw uses, in one place.

Twisted promises nothing about names with a leading underscore, nor about
the modules whose name starts with one (its compatibility policy covers
public names only): a release may rename or drop them without a
deprecation.  So llmgw imports them here and nowhere else
(C{tests.test_twisted_private} fails on a private import from Twisted in
any other module of llmgw), and this module lists each private method
llmgw overrides and each private attribute it reads or sets, in
L{PRIVATE_USES}; the same test fails when one of them is no longer found on
its Twisted class, so an upgrade that removes one fails loudly instead of
turning an override into dead code.

Checked on Twisted 26.4.0 and 26.10.0: every name below is there, and the
code llmgw copies (L{GenericHTTPChannelProtocol}'s switch to HTTP/2) is
the same in both.  26.10 is the floor in setup.cfg because of the HTTP/2
rapid-reset defence (C{_resetTokenBurst}, C{_resetTokenRate}: a token
bucket on peer stream resets, ending the connection with GOAWAY
C{ENHANCE_YOUR_CALM}, the CVE-2023-44487 defence), which 26.4.0 does not
have and L{llmgw.router.edge.connections} relies on.

Imported names:

  - L{H2Connection} (C{twisted.web._http2}): Twisted's HTTP/2 server
    connection.  L{llmgw.router.edge.connections.EdgeH2Connection} subclasses it
    to drop answers to streams a client reset and to hold request bodies to
    C{min_body_rate}.  If it moves: the router does not import, no daemon
    with a router starts.
  - L{GenericHTTPChannelProtocol} (C{twisted.web.http._GenericHTTPChannelProtocol}):
    the protocol a L{twisted.web.server.Site} builds per connection, which
    switches from HTTP/1.1 to HTTP/2 when ALPN chose C{h2}.
    L{llmgw.router.edge.connections.EdgeProtocol} subclasses it to count the
    connection against the caps and to switch to C{EdgeH2Connection}
    instead.  If it moves: as above.
  - L{HTTP11ClientFactory} (C{twisted.web.client._HTTP11ClientFactory}):
    the factory L{twisted.web.client.HTTPConnectionPool} builds per
    connection; L{llmgw.agent.quiet_pool} subclasses it to turn off its
    start and stop log lines.  If it moves: the agent does not import.

Private attributes and methods used, each a L{PrivateUse} in
L{PRIVATE_USES} (name; kind; llmgw's use; what breaks if Twisted changes
it):

  - C{_GenericHTTPChannelProtocol._channel}; attribute; EdgeProtocol reads
    the channel and puts EdgeH2Connection in its place; AttributeError on
    a TLS connection's first read.
  - C{_GenericHTTPChannelProtocol._negotiatedProtocol}; attribute; set to
    C{b"h2"} after EdgeProtocol's switch; Twisted's own switch runs too
    and HTTP/2 is served by a plain H2Connection (no body-rate limit).
  - C{_GenericHTTPChannelProtocol._requestFactory}, C{._site},
    C{._factory}, C{._timeOut}, C{._callLater}; attributes; copied onto the
    new HTTP/2 channel as Twisted's switch does; HTTP/2 requests without a
    site or request factory fail.
  - C{_GenericHTTPChannelProtocol.dataReceived}; copied code;
    C{EdgeProtocol._switch_to_h2} is Twisted's switch with another class;
    the copy drifts from Twisted's (the test compares the source's digest
    with the one checked: on a change, re-read both and record the new).
  - C{HTTPChannel._networkProducer}; attribute; the producer moved from the
    HTTP/1.1 channel to the HTTP/2 one; AttributeError on the switch.
  - C{HTTPChannel._maybeChooseTransferDecoder}; method; EdgeChannel answers
    400 to both Content-Length and Transfer-Encoding; the override is never
    called and such requests pass (request smuggling).
  - C{HTTPChannel._transferDecoder}; attribute; whether a body framing was
    chosen already; AttributeError on each request with a body.
  - C{HTTPChannel._respondToBadRequestAndDisconnect}; method; EdgeChannel
    answers an OpenAI error object; the override is never called, the
    client gets Twisted's bare 400.
  - C{H2Connection._requestReceived}, C{._requestDataReceived},
    C{._requestEnded}, C{._requestAborted}; methods; EdgeH2Connection times
    each request body (C{min_body_rate}); the overrides are never called and
    a slow HTTP/2 body holds its stream for ever.
  - C{H2Connection._reactor}; attribute; the clock of those timers;
    AttributeError on the first HTTP/2 request with a body.
  - C{H2Connection.connectionLost}'s C{_cancelTimeouts}; parameter; passed
    on by EdgeH2Connection's override; TypeError when a connection closes.
  - C{H2Connection._resetTokenBurst}, C{._resetTokenRate}; attributes; not
    in llmgw's code: the rapid-reset defence the router relies on (26.10);
    without them the router is open to CVE-2023-44487 again.
  - C{HTTPConnectionPool._factory}; attribute; QuietConnectionPool sets its
    factory class; the override is ignored and the agent logs two lines
    per engine health probe again.

Not Twisted's, but as private: L{llmgw.router.edge.connections} reads h2's
connection state machine (C{H2Connection.conn.state_machine.state}) and a
stream's C{closed}, neither documented by h2; C{tests.test_e2e_edge_h2}
covers them.  Twisted's public but lightly documented C{HTTPChannel} hooks
that L{llmgw.router.edge.channel} overrides (C{lineReceived}, C{rawDataReceived},
C{allHeadersReceived}, C{allContentReceived}, C{requestDone},
C{setTimeout}, C{totalHeadersSize}, C{maxHeaders}) are public names and
are not listed.

A leaf: it imports nothing from the rest of llmgw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from twisted.web._http2 import H2Connection
from twisted.web.client import HTTPConnectionPool, _HTTP11ClientFactory
from twisted.web.http import HTTPChannel, _GenericHTTPChannelProtocol

__all__ = [
    "PRIVATE_USES",
    "GenericHTTPChannelProtocol",
    "H2Connection",
    "HTTP11ClientFactory",
    "PrivateUse",
]

GenericHTTPChannelProtocol = _GenericHTTPChannelProtocol
HTTP11ClientFactory = _HTTP11ClientFactory


@dataclass(frozen=True)
class PrivateUse:
    """
    One private name of a Twisted class that llmgw relies on.

    @ivar owner: the Twisted class that defines it.
    @ivar name: the attribute, method or parameter name (C{"_channel"}).
    @ivar kind: C{"method"}, a private method llmgw overrides or calls;
        C{"attribute"}, set by Twisted on the class or on each instance
        (after C{makeConnection} for a protocol) and read or set by llmgw;
        C{"parameter"}, a parameter of the method C{method} that llmgw's
        override passes on; C{"copied"}, a method whose code llmgw copies,
        with the SHA-256 of its source (C{inspect.getsource}, dedented) as
        checked in C{source_sha256}.
    @ivar user: the llmgw module that uses it.
    @ivar method: for C{"parameter"}, the method that takes it.
    @ivar source_sha256: for C{"copied"}, the hex digest of the source
        checked on the Twisted versions named in this module's docstring.
    """

    owner: type
    name: str
    kind: Literal["method", "attribute", "parameter", "copied"]
    user: str
    method: str = ""
    source_sha256: str = ""


_CONNECTIONS = "llmgw.router.edge.connections"
_EDGE = "llmgw.router.edge.channel"
_QUIET_POOL = "llmgw.agent.quiet_pool"

PRIVATE_USES: tuple[PrivateUse, ...] = (
    *(
        PrivateUse(_GenericHTTPChannelProtocol, name, "attribute", _CONNECTIONS)
        for name in (
            "_channel",
            "_negotiatedProtocol",
            "_requestFactory",
            "_site",
            "_factory",
            "_timeOut",
            "_callLater",
        )
    ),
    PrivateUse(
        _GenericHTTPChannelProtocol,
        "dataReceived",
        "copied",
        _CONNECTIONS,
        source_sha256="c64227dd85cb58a334b7aa2391f882f0b81fbbb8cdfd996780b545ee0c8e9436",
    ),
    PrivateUse(HTTPChannel, "_networkProducer", "attribute", _CONNECTIONS),
    PrivateUse(HTTPChannel, "_maybeChooseTransferDecoder", "method", _EDGE),
    PrivateUse(HTTPChannel, "_transferDecoder", "attribute", _EDGE),
    PrivateUse(HTTPChannel, "_respondToBadRequestAndDisconnect", "method", _EDGE),
    *(
        PrivateUse(H2Connection, name, "method", _CONNECTIONS)
        for name in (
            "_requestReceived",
            "_requestDataReceived",
            "_requestEnded",
            "_requestAborted",
        )
    ),
    PrivateUse(H2Connection, "_reactor", "attribute", _CONNECTIONS),
    PrivateUse(
        H2Connection,
        "_cancelTimeouts",
        "parameter",
        _CONNECTIONS,
        method="connectionLost",
    ),
    PrivateUse(H2Connection, "_resetTokenBurst", "attribute", _CONNECTIONS),
    PrivateUse(H2Connection, "_resetTokenRate", "attribute", _CONNECTIONS),
    PrivateUse(HTTPConnectionPool, "_factory", "attribute", _QUIET_POOL),
)
"""
Each private name of Twisted llmgw relies on (the table in this module's
docstring), checked against the installed Twisted by
C{tests.test_twisted_private}.
"""
