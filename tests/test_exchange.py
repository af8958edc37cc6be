"""
The exchange in process: a fake agent, a fake clock, fake requests.
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any, TypeVar, cast

from prometheus_client import CollectorRegistry
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest

from llmgw.router.api.exchange import Exchange, Services
from llmgw.router.api.prepare import prepare
from llmgw.router.errors import APIError
from llmgw.router.interfaces import Endpoint
from llmgw.router.routing.activation import ActivationQueues
from llmgw.router.routing.balancer import Balancer
from llmgw.router.settings import RouterConfig
from llmgw.router.telemetry.metrics import RouterMetrics
from llmgw.router.upstream.base import NoAnswer, UpstreamConnectError
from tests.exchange_fakes import FakeAgent, FakeRequest, FakeResponse
from tests.typing_support import collect

CHAT = b"/v1/chat/completions"
SSE = b"text/event-stream"
CHUNK = b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"
SETTINGS = RouterConfig(
    connect_timeout=5,
    first_byte_timeout=10,
    idle_timeout=3,
    total_timeout=100,
    max_retries=2,
)

if TYPE_CHECKING:
    from _typeshed import SupportsLenAndGetItem

T = TypeVar("T")


class _FirstChoice(random.Random):
    def choice(self, seq: SupportsLenAndGetItem[T]) -> T:
        return seq[0]


class ExchangeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.agent = FakeAgent()
        # Ties go to the first replica listed, so that each test knows which
        # replica its first attempt reaches.
        self.balancer = Balancer(self.clock, 10.0, rng=_FirstChoice())
        self.balancer.set_endpoints(
            [Endpoint("r1", "http://a:1", ("m",)), Endpoint("r2", "http://b:2", ("m",))]
        )
        self.request = FakeRequest()
        self.logged: list[dict[str, Any]] = []
        self.metrics = RouterMetrics(CollectorRegistry())

    def start(
        self, stream: bool = False, settings: RouterConfig = SETTINGS
    ) -> tuple[Exchange, Deferred[bytes | None]]:
        """
        Start an exchange for model C{m}.
        """
        services = Services(
            clock=self.clock,
            settings=settings,
            balancer=self.balancer,
            upstream=self.agent,
            metrics=self.metrics,
            activator=None,
            activating=ActivationQueues(),
            log=Logger(observer=collect(self.logged)),
        )
        body = json.dumps(
            {"model": "m", "stream": stream, "messages": [{"role": "user"}]}
        ).encode()
        prepared = prepare(body, CHAT, lambda m: m == "m", lambda m: None)
        exchange = Exchange(
            services, cast(IRequest, self.request), CHAT, prepared, b"id", b"uid"
        )
        done = Deferred.fromCoroutine(exchange.run())

        def finish(result: object) -> object:
            exchange.finish()
            return result

        done.addBoth(finish)
        self.addCleanup(lambda: self.assertEqual(self.clock.getDelayedCalls(), []))
        return exchange, done

    def error_of(self, done: Deferred[Any]) -> APIError:
        error = self.failureResultOf(done, APIError).value
        assert isinstance(error, APIError)
        return error

    def answer(
        self, index: int, code: int = 200, content_type: bytes = b"application/json"
    ) -> FakeResponse:
        response = FakeResponse(code, content_type)
        self.agent.sent[index].answer.callback(response)
        return response

    def retries(self) -> float:
        return sum(
            s.value
            for m in self.metrics.retries.collect()
            for s in m.samples
            if s.name.endswith("_total")
        )

    def test_whole_answer(self) -> None:
        """
        A whole answer is returned with its usage; the engine got the
        body, the upstream id and the accept header.
        """
        self.request.headers[b"accept"] = b"application/json"
        exchange, done = self.start()
        sent = self.agent.sent[0]
        self.assertEqual(sent.uri, b"http://a:1" + CHAT)
        self.assertEqual(sent.headers.getRawHeaders(b"x-request-id"), [b"uid"])
        self.assertEqual(
            json.loads(sent.body),
            {"model": "m", "stream": False, "messages": [{"role": "user"}]},
        )
        response = self.answer(0)
        self.clock.advance(1)
        response.write(b'{"usage": {"prompt_tokens": 4}}')
        response.end()
        self.assertEqual(self.successResultOf(done), b'{"usage": {"prompt_tokens": 4}}')
        self.assertEqual(exchange.usage, {"prompt_tokens": 4})
        self.assertEqual(exchange.first_byte_at, 1)
        self.assertEqual(self.request.code, 200)

    def test_first_byte_deadline(self) -> None:
        """
        No answer within first_byte_timeout: a 504 naming the phase, the
        upstream request cancelled, no retry.
        """
        _, done = self.start()
        self.clock.advance(9.9)
        self.assertNoResult(done)
        self.clock.advance(0.1)
        error = self.error_of(done)
        self.assertEqual((error.status, error.code), (504, "first_byte_timeout"))
        self.assertTrue(self.agent.sent[0].cancelled)
        self.assertEqual(len(self.agent.sent), 1)

    def test_first_byte_deadline_headers_without_body(self) -> None:
        """
        Headers without a body byte do not end the first-byte phase.
        """
        _, done = self.start()
        response = self.answer(0)
        self.clock.advance(10)
        self.assertEqual(self.error_of(done).code, "first_byte_timeout")
        self.assertTrue(response.transport.stopped)

    def test_idle_deadline(self) -> None:
        """
        A stream that stalls for idle_timeout ends with an error event; bytes
        within it keep it going.
        """
        _, done = self.start(stream=True)
        response = self.answer(0, content_type=SSE)
        for _ in range(4):
            response.write(CHUNK)
            self.clock.advance(2.9)
        self.assertNoResult(done)
        self.clock.advance(0.1)
        self.assertIsNone(self.successResultOf(done))
        self.assertEqual(self.request.written[:4], [CHUNK] * 4)
        last = json.loads(self.request.written[-1][len(b"data: ") :])
        self.assertEqual(last["error"]["code"], "idle_timeout")
        self.assertTrue(response.transport.stopped)

    def test_idle_deadline_stops_while_client_holds_back(self) -> None:
        """
        While the client's connection has paused the relay (llmgw stopped
        reading the engine for a slow client), the idle deadline does not
        run: the engine is not late.  Once resumed it starts over.
        """
        _, done = self.start(stream=True)
        response = self.answer(0, content_type=SSE)
        response.write(CHUNK)
        self.clock.advance(2)
        self.request.producer.pauseProducing()
        self.assertTrue(response.transport.paused)
        self.clock.advance(30)
        self.assertNoResult(done)
        self.request.producer.resumeProducing()
        self.assertFalse(response.transport.paused)
        self.clock.advance(2.9)
        self.assertNoResult(done)
        self.clock.advance(0.1)
        self.assertIsNone(self.successResultOf(done))
        last = json.loads(self.request.written[-1][len(b"data: ") :])
        self.assertEqual(last["error"]["code"], "idle_timeout")
        self.assertFalse(self.request.channel.aborted)

    def test_stalled_client_cut(self) -> None:
        """
        A client that holds the stream back and reads nothing for
        client_stall_timeout is cut (its connection aborted), with a
        warning naming it and the request, not the replica; bytes leaving
        for it in the meantime count as reading.
        """
        settings = RouterConfig(idle_timeout=3, client_stall_timeout=8)
        _, done = self.start(stream=True, settings=settings)
        response = self.answer(0, content_type=SSE)
        response.write(CHUNK)
        unsent = self.request.channel.transport
        unsent.dataBuffer = b"x" * 100_000
        self.request.producer.pauseProducing()
        self.clock.pump([1] * 4)
        unsent.offset = 4096  # the client read a little (seen at 6 s)
        self.clock.pump([1] * 9)
        self.assertFalse(self.request.channel.aborted)
        self.clock.advance(1)
        self.assertTrue(self.request.channel.aborted)
        (warning,) = [e for e in self.logged if "read nothing" in e["log_format"]]
        self.assertEqual(
            (warning["client"], warning["request_id"], warning["seconds"]),
            ("10.0.0.9:4321", "id", 8),
        )
        self.assertNotIn("replica", warning)
        # The connection's loss cancels the request (Klein does so).
        self.request._disconnected = True
        done.cancel()
        self.failureResultOf(done, CancelledError)
        self.assertTrue(response.transport.stopped)

    def test_total_deadline(self) -> None:
        """
        The total deadline ends a stream whose chunks keep coming.
        """
        settings = RouterConfig(first_byte_timeout=10, idle_timeout=3, total_timeout=20)
        _, done = self.start(stream=True, settings=settings)
        response = self.answer(0, content_type=SSE)
        for _ in range(10):
            response.write(CHUNK)
            self.clock.advance(2)
        last = json.loads(self.request.written[-1][len(b"data: ") :])
        self.assertEqual(last["error"]["code"], "total_timeout")
        self.assertIsNone(self.successResultOf(done))

    def test_retry_stale_pooled_connection(self) -> None:
        """
        A pooled connection closed before any answer byte: the request goes
        to another replica, once.
        """
        _, done = self.start()
        self.agent.sent[0].answer.errback(NoAnswer("closed", reused=True))
        self.assertEqual(len(self.agent.sent), 2)
        self.assertNotEqual(self.agent.sent[1].uri, self.agent.sent[0].uri)
        self.agent.sent[1].answer.errback(NoAnswer("closed", reused=True))
        self.assertEqual(self.error_of(done).status, 502)
        self.assertEqual(len(self.agent.sent), 2)
        self.assertEqual(self.retries(), 1)

    def test_new_connection_not_retried(self) -> None:
        """
        A new connection closed before any answer byte: the engine had the
        request; it is not sent again.
        """
        _, done = self.start()
        self.agent.sent[0].answer.errback(NoAnswer("closed", reused=False))
        self.assertEqual(self.error_of(done).status, 502)
        self.assertEqual(len(self.agent.sent), 1)

    def test_retry_connect_and_503(self) -> None:
        """
        A refused connection and a 503 are retried on other replicas, within
        max_retries; the answer of the last try is the client's.
        """
        self.balancer.set_endpoints(
            [Endpoint(f"r{i}", f"http://h{i}:1", ("m",)) for i in range(4)]
        )
        _, done = self.start()
        self.agent.sent[0].answer.errback(UpstreamConnectError("refused", False))
        self.answer(1, code=503).end()
        self.assertEqual(len(self.agent.sent), 3)
        response = self.answer(2)
        response.write(b"{}")
        response.end()
        self.assertEqual(self.successResultOf(done), b"{}")
        self.assertEqual(len({s.uri for s in self.agent.sent}), 3)
        self.assertEqual(self.retries(), 2)

    def test_no_retry_after_first_byte(self) -> None:
        """
        Once a byte of the answer came, a broken exchange is not retried:
        a stream ends with an error event, a whole answer with a 502.
        """
        _, done = self.start(stream=True)
        response = self.answer(0, content_type=SSE)
        response.write(CHUNK)
        response.lose(OSError("reset"))
        self.assertIsNone(self.successResultOf(done))
        self.assertEqual(len(self.agent.sent), 1)
        last = json.loads(self.request.written[-1][len(b"data: ") :])
        self.assertEqual(last["error"]["code"], "upstream_error")

        self.request = FakeRequest()
        self.logged = []
        _, done = self.start()
        response = self.answer(1)
        response.write(b'{"partial"')
        response.lose(OSError("reset"))
        self.assertEqual(self.error_of(done).status, 502)
        self.assertEqual(len(self.agent.sent), 2)

    def test_relay_strips_usage(self) -> None:
        """
        A stream whose client did not ask for usage is relayed without its
        usage-only chunk, however the engine cuts it; the usage is kept, and
        a slow client holds back the engine.
        """
        exchange, done = self.start(stream=True)
        self.assertIn(b'"include_usage"', self.agent.sent[0].body)
        response = self.answer(0, content_type=SSE)
        self.assertEqual(self.request.response_headers[b"content-type"], SSE)
        # The client's pauses reach the engine's connection.
        self.request.producer.pauseProducing()
        self.assertTrue(response.transport.paused)
        self.request.producer.resumeProducing()
        self.assertFalse(response.transport.paused)
        stream = CHUNK + CHUNK + USAGE + DONE
        response.write(stream[:5])
        self.assertEqual(self.request.written, [])
        for i in range(5, len(stream), 9):
            response.write(stream[i : i + 9])
        response.end()
        self.assertIsNone(self.successResultOf(done))
        self.assertEqual(b"".join(self.request.written), CHUNK + CHUNK + DONE)
        self.assertEqual(exchange.usage, {"prompt_tokens": 3, "completion_tokens": 2})
        self.assertEqual(exchange.events_relayed, 3)
        self.assertIsNone(self.request.producer)

    def test_stream_cut_mid_event(self) -> None:
        """
        A stream that ends inside an event ends with an error event instead
        of the half event.
        """
        _, done = self.start(stream=True)
        response = self.answer(0, content_type=SSE)
        response.write(CHUNK + b'data: {"cho')
        response.end()
        self.assertIsNone(self.successResultOf(done))
        self.assertEqual(self.request.written[0], CHUNK)
        self.assertIn(b"in the middle of an event", self.request.written[-1])

    def test_disconnect_cancels_upstream(self) -> None:
        """
        A client that leaves mid-stream (Klein cancels the handler) closes
        the upstream connection; one that leaves before the answer cancels
        the upstream request.
        """
        _, done = self.start(stream=True)
        response = self.answer(0, content_type=SSE)
        response.write(CHUNK)
        self.request._disconnected = True
        done.cancel()
        self.failureResultOf(done, CancelledError)
        self.assertTrue(response.transport.stopped)

        self.request = FakeRequest()
        self.logged = []
        _, done = self.start()
        self.request._disconnected = True
        done.cancel()
        self.failureResultOf(done, CancelledError)
        self.assertTrue(self.agent.sent[1].cancelled)
        self.assertEqual(len(self.agent.sent), 2)
