"""
The floor for llmgw's throughput benchmark: the least a Twisted reverse
proxy can do for an OpenAI-style POST.

A L{Site} with one leaf L{Resource} whose C{render_POST} forwards the body
with an L{Agent} over a persistent L{HTTPConnectionPool} to one upstream,
then relays the status, the content type and the body chunk by chunk as
they arrive.  No Klein, no treq, no parsing, no routing, no access log.

Run::

    python bench/minimal_proxy.py --port P --upstream http://127.0.0.1:PORT

It prints C{minimal proxy listening on 127.0.0.1:PORT} once listening and
runs until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, cast

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IConsumer, IPushProducer
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IResponse
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site
from zope.interface import implementer


@implementer(IBodyProducer)
class _Body:
    """
    A request body already in memory, written in one go (L{FileBodyProducer}
    would go through a cooperator, one more reactor turn per request).
    """

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.length = len(data)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        consumer.write(self._data)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class _Relay(Protocol):
    """
    Writes each chunk of the upstream body to the client as it arrives.
    """

    def __init__(self, request: Request) -> None:
        self._request = request
        self.gone = False
        """
        C{True} once the client has gone: nothing more is written.
        """
        request.notifyFinish().addErrback(self._client_gone)

    def _client_gone(self, reason: Failure) -> None:
        self.gone = True
        self._stop_upstream()

    def _stop_upstream(self) -> None:
        # The response body's transport is an IPushProducer: stopping it
        # closes the upstream connection instead of reading a body no one
        # wants.
        producer = cast(IPushProducer | None, self.transport)
        if producer is not None:
            producer.stopProducing()

    def connectionMade(self) -> None:
        # A client gone before the answer's head came: the body is read to
        # its end and dropped, not stopped.  deliverBody runs in the middle
        # of Twisted's parse of the upstream's bytes; stopping there closes
        # the connection (asynchronously) while the rest of the same read
        # completes the body and hands the connection back to the pool, and
        # the next request sent on it fails with ResponseNeverReceived.
        pass

    def dataReceived(self, data: bytes) -> None:
        if not self.gone:
            self._request.write(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.gone:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self._request.finish()
        else:
            # A body cut short upstream must look cut short to the client.
            self._request.loseConnection()


class Forward(Resource):
    """
    Forwards every POST to C{upstream} plus the request's path.
    """

    isLeaf = True

    def __init__(self, agent: Agent, upstream: bytes) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._agent = agent
        self._upstream = upstream.rstrip(b"/")

    def render_POST(self, request: Request) -> Any:
        content = request.content
        body = b"" if content is None else content.read()
        content_type = request.getHeader(b"content-type") or b"application/json"
        relay = _Relay(request)
        d = self._agent.request(
            b"POST",
            self._upstream + request.uri,
            Headers({b"content-type": [content_type]}),
            _Body(body),
        )
        d.addCallback(self._respond, request, relay)
        d.addErrback(self._fail, request, relay)
        return NOT_DONE_YET

    def _respond(self, response: IResponse, request: Request, relay: _Relay) -> None:
        request.setResponseCode(response.code)
        content_type = response.headers.getRawHeaders(b"content-type")
        if content_type:
            request.responseHeaders.setRawHeaders(b"content-type", content_type)
        response.deliverBody(relay)

    def _fail(self, reason: Failure, request: Request, relay: _Relay) -> None:
        if relay.gone:
            return
        sys.stderr.write(f"minimal proxy: upstream failed: {reason.value!r}\n")
        request.setResponseCode(502)
        request.write(f"upstream failed: {reason.getErrorMessage()}\n".encode())
        request.finish()


class _QuietSite(Site):
    """
    A L{Site} without the access log: the floor does no per-request I/O.
    """

    def log(self, request: Any) -> None:
        pass


def main(argv: list[str]) -> int:
    """
    Listen on 127.0.0.1 and forward until SIGINT or SIGTERM.

    @return: 0 after a signal.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--port", type=int, default=0, help="TCP port; 0 picks one")
    p.add_argument(
        "--upstream", required=True, help="base URL, e.g. http://127.0.0.1:8000"
    )
    args = p.parse_args(argv)
    from twisted.internet import reactor

    pool = HTTPConnectionPool(reactor, persistent=True)
    pool.maxPersistentPerHost = 256
    # Idle connections closed after 4 s, as llmgw's are: the simulator's
    # twisted.web closes them after 60 s idle (HTTPFactory's timeout), and
    # a POST sent on one it closed fails (Agent does not retry POSTs).
    # With Twisted's 240 s, the first requests of each timed run, minutes
    # after the last, failed with ResponseNeverReceived.
    pool.cachedConnectionTimeout = 4
    agent = Agent(reactor, pool=pool)
    # No form parsing either: llmgw turns it off too (JSON bodies only).
    site = _QuietSite(  # type: ignore[no-untyped-call]
        Forward(agent, args.upstream.encode("ascii")),
        parsePOSTFormSubmission=False,
    )
    port = reactor.listenTCP(args.port, site, interface="127.0.0.1")  # type: ignore[arg-type]
    address = cast(IPv4Address, port.getHost())
    sys.stdout.write(f"minimal proxy listening on {address.host}:{address.port}\n")
    sys.stdout.flush()
    reactor.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
