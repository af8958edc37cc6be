"""
L{llmgw.router.api.fastpath.ForwardingRoutes}: which requests skip Klein, and
what it keeps of Klein's handling (the answer written and the request
finished, the handler cancelled when the client goes away, an unexpected
failure logged and answered 500).

Routing goes through L{StubTreq}, whose requests are twisted.web's own
(their C{path} parsed from the request line, percent-encoding kept);
what is written and when the request finishes, through L{DummyRequest},
whose C{processingFailed} is what a lost connection does to the
C{notifyFinish} Deferreds of a real request.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionDone
from twisted.logger import LogEvent, Logger
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from llmgw.router.api.app import FORWARDED_PATHS, Router
from llmgw.router.api.fastpath import ForwardingRoutes
from tests.typing_support import as_request, collect, stub_treq

PATHS = {
    b"/v1/chat/completions": b"/v1/chat/completions",
    # Taken at one path, forwarded to another: the handler must get the
    # mapping's value, not the request's path.
    b"/tokenize": b"/engine/tokenize",
}


class _Fallback(Resource):
    """
    Stands for Klein's resource: records what it was given.
    """

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bytes, bytes]] = []

    def render(self, request: IRequest) -> bytes:
        assert request.method is not None and request.path is not None
        self.seen.append((request.method, request.path))
        return b"fallback"


class _Request(DummyRequest):
    """
    A L{DummyRequest} for a POST to C{path} that records each
    C{processingFailed} call (a lost connection's, or the routes').
    """

    def __init__(self, path: bytes) -> None:
        super().__init__(path.lstrip(b"/").split(b"/"))
        self.method = b"POST"
        self.path = path
        self.failed: list[Failure] = []

    def processingFailed(self, reason: Failure) -> None:
        self.failed.append(reason)
        super().processingFailed(reason)


class ForwardingRoutesTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.calls: list[tuple[bytes, bytes]] = []
        self.pending: list[Deferred[Any]] = []
        self.cancelled: list[bytes] = []
        self.fallback = _Fallback()
        self.events: list[LogEvent] = []
        self.routes = ForwardingRoutes(self.handler, PATHS, self.fallback)
        self.routes.log = Logger(observer=collect(self.events))
        self.stub = stub_treq(self.routes)

    async def handler(self, request: IRequest, path: bytes) -> bytes | None:
        """
        Waits for the test to fire C{self.pending[-1]}; notes a
        cancellation and lets it propagate, as Router._forward's callees do.
        """
        assert request.method is not None and request.path is not None
        self.calls.append((request.method, path))
        answer: Deferred[bytes | None] = Deferred()
        self.pending.append(answer)
        try:
            return await answer
        except CancelledError:
            self.cancelled.append(path)
            raise

    def response(self, method: str, path: str) -> Any:
        """
        @return: the response to C{method} on C{path}, fired.
        """
        d = self.stub.request(method, "http://gw" + path, data=b"{}")
        self.stub.flush()
        return self.successResultOf(d)

    def test_exact_post_goes_to_the_handler(self) -> None:
        """
        A POST to one of the paths goes to the handler, with the path the
        mapping forwards it to, and its answer is the handler's bytes; the
        fallback sees nothing.
        """
        for path, upstream in PATHS.items():
            d = self.stub.post("http://gw" + path.decode(), data=b"{}")
            self.stub.flush()
            self.assertNoResult(d)
            self.assertEqual(self.calls[-1], (b"POST", upstream))
            self.pending[-1].callback(b"answer " + upstream)
            self.stub.flush()
            response = self.successResultOf(d)
            self.assertEqual(response.code, 200)
            self.assertEqual(
                self.successResultOf(response.content()), b"answer " + upstream
            )
        self.assertEqual(len(self.calls), 2)
        self.assertEqual(self.fallback.seen, [])

    def test_everything_else_goes_to_the_fallback(self) -> None:
        """
        Another method on a forwarded path, another path, a percent-encoded
        spelling of a forwarded path (raw bytes compared, not decoded) and
        a path with a trailing slash all go to the fallback, untouched; the
        handler is never called.
        """
        cases = [
            ("GET", "/v1/chat/completions"),
            ("PUT", "/v1/chat/completions"),
            ("POST", "/v1/models"),
            ("POST", "/v1/chat/%63ompletions"),
            ("POST", "/v1/chat/completions/"),
            ("POST", "/engine/tokenize"),
        ]
        for method, path in cases:
            response = self.response(method, path)
            self.assertEqual(self.successResultOf(response.content()), b"fallback")
        self.assertEqual(
            self.fallback.seen,
            [(method.encode(), path.encode()) for method, path in cases],
        )
        self.assertEqual(self.calls, [])

    def test_query_string_still_forwarded(self) -> None:
        """
        A query string is not part of the path: the POST still goes to the
        handler.
        """
        d = self.stub.post("http://gw/v1/chat/completions?x=1", data=b"{}")
        self.stub.flush()
        self.assertEqual(self.calls, [(b"POST", b"/v1/chat/completions")])
        self.pending[-1].callback(b"ok")
        self.stub.flush()
        self.assertEqual(self.successResultOf(d).code, 200)

    def test_bytes_written_then_finished(self) -> None:
        """
        Nothing is written before the handler answers; then its bytes are
        written once and the request finished once.
        """
        request = _Request(b"/v1/chat/completions")
        self.assertIs(self.routes.render(as_request(request)), NOT_DONE_YET)
        self.assertEqual((request.written, request.finished), ([], 0))
        self.pending[-1].callback(b'{"id": 1}')
        self.assertEqual(request.written, [b'{"id": 1}'])
        self.assertEqual(request.finished, 1)

    def test_answer_given_at_once(self) -> None:
        """
        A handler that answers without waiting gets the same: its bytes
        written, the request finished.
        """

        async def at_once(request: IRequest, path: bytes) -> bytes | None:
            return b"now"

        routes = ForwardingRoutes(at_once, PATHS, self.fallback)
        request = _Request(b"/v1/chat/completions")
        self.assertIs(routes.render(as_request(request)), NOT_DONE_YET)
        self.assertEqual((request.written, request.finished), ([b"now"], 1))

    def test_none_finishes_without_a_body(self) -> None:
        """
        A handler that wrote its answer itself returns L{None}: the request
        is finished, and nothing more is written.
        """
        request = _Request(b"/tokenize")
        self.routes.render(as_request(request))
        request.write(b"data: streamed\n\n")
        self.pending[-1].callback(None)
        self.assertEqual(request.written, [b"data: streamed\n\n"])
        self.assertEqual(request.finished, 1)

    def test_client_gone_cancels_the_handler(self) -> None:
        """
        When the client goes away (the request's C{notifyFinish} fails) the
        handler's pending await is cancelled; nothing is written, the
        request is not finished, and the cancellation is not logged as an
        error.
        """
        request = _Request(b"/v1/chat/completions")
        self.routes.render(as_request(request))
        pending = self.pending[-1]
        request.processingFailed(Failure(ConnectionDone()))
        self.assertTrue(pending.called)
        self.assertEqual(self.cancelled, [b"/v1/chat/completions"])
        self.assertEqual((request.written, request.finished), ([], 0))
        self.assertEqual(self.events, [])

    def test_answer_after_client_gone_dropped(self) -> None:
        """
        A handler that catches the cancellation and answers anyway (as
        Router._forward does, counting the request as a 499) writes
        nothing and does not finish the request: twisted.web's C{finish}
        raises after a disconnect.
        """

        async def answers_anyway(request: IRequest, path: bytes) -> bytes | None:
            answer: Deferred[bytes | None] = Deferred()
            self.pending.append(answer)
            try:
                return await answer
            except CancelledError:
                self.cancelled.append(path)
                return b"too late"

        routes = ForwardingRoutes(answers_anyway, PATHS, self.fallback)
        routes.log = Logger(observer=collect(self.events))
        request = _Request(b"/v1/chat/completions")
        routes.render(as_request(request))
        request.processingFailed(Failure(ConnectionDone()))
        self.assertEqual(self.cancelled, [b"/v1/chat/completions"])
        self.assertEqual((request.written, request.finished), ([], 0))
        # The connection's only: the answer did not fail the request again.
        self.assertEqual(len(request.failed), 1)
        self.assertEqual(self.events, [])

    def test_handler_failure_logged_and_500(self) -> None:
        """
        A handler that raises, at once or after waiting, has its failure
        logged once, with the path, and the client gets a 500 OpenAI error
        object; nothing escapes C{render}.
        """

        async def fails(request: IRequest, path: bytes) -> bytes | None:
            if request.getHeader(b"x-wait"):
                answer: Deferred[None] = Deferred()
                self.pending.append(answer)
                await answer
            raise ValueError("boom")

        routes = ForwardingRoutes(fails, PATHS, self.fallback)
        routes.log = Logger(observer=collect(self.events))
        stub = stub_treq(routes)
        for headers in ({}, {"x-wait": "1"}):
            d = stub.post("http://gw/v1/chat/completions", data=b"{}", headers=headers)
            stub.flush()
            if headers:
                self.assertNoResult(d)
                self.pending[-1].callback(None)
                stub.flush()
            response = self.successResultOf(d)
            self.assertEqual(response.code, 500)
            self.assertEqual(
                response.headers.getRawHeaders(b"content-type"), [b"application/json"]
            )
            body = json.loads(self.successResultOf(response.content()))
            self.assertEqual(body["error"]["type"], "api_error")
        self.assertEqual(len(self.events), 2)
        for event in self.events:
            self.assertEqual(event["path"], b"/v1/chat/completions")
            self.assertIsInstance(event["log_failure"].value, ValueError)
        # Logged once each, not again by twisted.web.
        self.assertEqual(self.flushLoggedErrors(ValueError), [])

    def test_failure_after_client_gone_only_logged(self) -> None:
        """
        A handler that fails with another error once the client has gone is
        logged, and the request is neither answered nor failed again.
        """

        async def fails_late(request: IRequest, path: bytes) -> bytes | None:
            answer: Deferred[None] = Deferred()
            self.pending.append(answer)
            try:
                await answer
            except CancelledError:
                raise ValueError("while cleaning up") from None
            return b"unreachable"

        routes = ForwardingRoutes(fails_late, PATHS, self.fallback)
        routes.log = Logger(observer=collect(self.events))
        request = _Request(b"/v1/chat/completions")
        routes.render(as_request(request))
        request.processingFailed(Failure(ConnectionDone()))
        # The connection's only.
        self.assertEqual(len(request.failed), 1)
        self.assertEqual((request.written, request.finished), ([], 0))
        (event,) = self.events
        self.assertIsInstance(event["log_failure"].value, ValueError)


class ForwardedPathsTests(SynchronousTestCase):
    def test_each_forwarded_path_has_a_klein_route(self) -> None:
        """
        Each of the router's forwarded paths forwards to itself and has a
        Klein route for POST, which serves the spellings the fast path
        passes on (percent-encoded).
        """
        routes = Router.app.url_map.bind("gw")
        self.assertEqual(len(FORWARDED_PATHS), 10)
        for path, upstream in FORWARDED_PATHS.items():
            self.assertEqual(upstream, path)
            endpoint, _ = routes.match(path.decode(), method="POST")
            self.assertTrue(endpoint, path)
