"""
Tests for L{llmgw.sim}: the engine simulator.

Three layers: the generation model and scheduler on their own; the real
L{SimSite} fed bytes through a L{StringTransport} under a L{Clock} (exact
timing, disconnects, faults); and the simulator on a real port on
127.0.0.1, ending with the C{llmgw sim} child process and the official
C{openai} client.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any, cast

import treq
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import reactor as _reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import (
    CancelledError,
    Deferred,
    ensureDeferred,
)
from twisted.internet.error import ConnectionDone, ProcessDone, ProcessTerminated
from twisted.internet.protocol import ClientFactory, ProcessProtocol, Protocol
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport
from twisted.internet.threads import deferToThread
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import HTTPConnectionPool

from llmgw.sim.api import (
    ApiError,
    completion_text,
    parse_embeddings,
    parse_generation,
    stream_events,
)
from llmgw.sim.engine import (
    FAULT_KEYS,
    VOCAB,
    FaultError,
    QueueFull,
    Scheduler,
    SimConfig,
    Simulator,
    completion_tokens,
    count_prompt_tokens,
    embedding_vector,
    parse_fault_option,
    validate_faults,
)
from llmgw.sim.web import DROP_DELAY, SimChannel, SimSite

reactor: Any = _reactor


# ---------------------------------------------------------------------------
# The generation model


class GenerationModelTests(SynchronousTestCase):
    """
    Deterministic tokens, token counting and embeddings.
    """

    def test_vocab_mixes_ascii_and_multibyte(self) -> None:
        """
        Every token text has a leading space; some are ASCII and some take
        2, 3 and 4 bytes per character in UTF-8.
        """
        self.assertGreaterEqual(len(VOCAB), 30)
        self.assertTrue(all(w.startswith(" ") for w in VOCAB))
        widths = {max(len(c.encode("utf-8")) for c in w) for w in VOCAB}
        self.assertEqual(widths, {1, 2, 3, 4})

    def test_token_i_follows_crc32(self) -> None:
        """
        Token i of the completion is VOCAB[(crc32(prompt) + i) % len(VOCAB)].
        """
        import zlib

        prompt = b"say something"
        tokens = completion_tokens(prompt, 40)
        base = zlib.crc32(prompt)
        self.assertEqual(tokens, [VOCAB[(base + i) % len(VOCAB)] for i in range(40)])
        self.assertEqual(completion_tokens(prompt, 40), tokens)
        self.assertNotEqual(completion_tokens(b"other", 5), tokens[:5])

    def test_prompt_tokens_are_words_at_least_one(self) -> None:
        """
        Prompt tokens count whitespace-separated words, and never fewer than
        one.
        """
        self.assertEqual(count_prompt_tokens("a  b\nc\t d"), 4)
        self.assertEqual(count_prompt_tokens(""), 1)
        self.assertEqual(count_prompt_tokens("   "), 1)

    def test_chat_prompt_joins_message_contents(self) -> None:
        """
        A chat prompt is every message's content, string or text parts,
        joined by spaces; max_completion_tokens counts as max_tokens.
        """
        body = {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hello"},
                        {"type": "image_url", "image_url": {"url": "x"}},
                        {"type": "text", "text": "wörld"},
                    ],
                },
            ],
            "max_completion_tokens": 3,
        }
        req = parse_generation("chat", json.dumps(body).encode())
        self.assertEqual(req.prompt, "be brief hello wörld".encode())
        self.assertEqual(req.prompt_tokens, 4)
        self.assertEqual(req.max_tokens, 3)
        self.assertFalse(req.stream)

    def test_bad_requests_are_400(self) -> None:
        """
        Bad JSON, a missing model and missing messages or prompt are 400s.
        """
        for kind, body in [
            ("chat", b"{"),
            ("chat", b"[]"),
            ("chat", b'{"messages": [{"content": "x"}]}'),
            ("chat", b'{"model": "m"}'),
            ("completion", b'{"model": "m"}'),
            ("completion", b'{"model": "m", "prompt": "x", "max_tokens": -1}'),
            ("completion", b'{"model": "m", "prompt": "x", "stream": "yes"}'),
        ]:
            with self.assertRaises(ApiError) as raised:
                parse_generation(kind, body)  # type: ignore[arg-type]
            self.assertEqual(raised.exception.status, 400)

    def test_embeddings_are_deterministic_unit_vectors(self) -> None:
        """
        An embedding has the configured length, Euclidean norm 1, and
        depends only on its input.
        """
        a = embedding_vector(b"hello", 16)
        self.assertEqual(len(a), 16)
        self.assertAlmostEqual(sum(x * x for x in a), 1.0)
        self.assertEqual(a, embedding_vector(b"hello", 16))
        self.assertNotEqual(a, embedding_vector(b"hellp", 16))

    def test_embedding_inputs(self) -> None:
        """
        Embeddings take a string, strings, a token list or token lists.
        """
        self.assertEqual(len(parse_embeddings(b'{"model":"m","input":"a"}').inputs), 1)
        req = parse_embeddings(b'{"model":"m","input":["a b","c"]}')
        self.assertEqual((len(req.inputs), req.prompt_tokens), (2, 3))
        req = parse_embeddings(b'{"model":"m","input":[1,2,3]}')
        self.assertEqual((len(req.inputs), req.prompt_tokens), (1, 3))
        req = parse_embeddings(b'{"model":"m","input":[[1,2],[3]]}')
        self.assertEqual((len(req.inputs), req.prompt_tokens), (2, 3))
        with self.assertRaises(ApiError):
            parse_embeddings(b'{"model":"m","input":[]}')

    @given(
        prompt=st.text(max_size=40),
        count=st.integers(min_value=0, max_value=40),
        chat=st.booleans(),
        usage=st.booleans(),
    )
    def test_stream_events_carry_the_completion(
        self, prompt: str, count: int, chat: bool, usage: bool
    ) -> None:
        """
        The SSE events are compact JSON whose token texts join into the
        completion, with C{"usage": null} on every chunk but the usage chunk
        when usage is asked for, and none at all otherwise.
        """
        body = {
            "model": "m",
            "stream": True,
            "max_tokens": count,
            "stream_options": {"include_usage": usage},
        }
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        req = parse_generation(
            "chat" if chat else "completion", json.dumps(body).encode()
        )
        events, first = stream_events(req, "id-1", 7, count)
        self.assertEqual(events[-1], b"data: [DONE]\n\n")
        chunks = [_event_json(e) for e in events[:-1]]
        text = "".join(
            (
                c["choices"][0]["delta"].get("content", "")
                if chat
                else c["choices"][0]["text"]
            )
            for c in chunks
            if c["choices"]
        )
        self.assertEqual(text, completion_text(prompt.encode(), count))
        self.assertEqual(first, 1 if chat else 0)
        if usage:
            self.assertEqual(chunks[-1]["choices"], [])
            self.assertEqual(chunks[-1]["usage"]["completion_tokens"], count)
            self.assertTrue(all(c["usage"] is None for c in chunks[:-1]))
        else:
            self.assertTrue(all("usage" not in c for c in chunks))
        final = chunks[-2] if usage else chunks[-1]
        self.assertEqual(final["choices"][0]["finish_reason"], "length")


def _event_json(event: bytes) -> Any:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n"), event
    return json.loads(event[6:-2])


class MetricsTests(SynchronousTestCase):
    """
    The simulator's own histogram follows Prometheus bucket rules.
    """

    def test_bucket_bounds_are_inclusive(self) -> None:
        sim = Simulator(SimConfig(models=("m",)), Clock())
        itl = sim.metrics.inter_token_latency
        itl.observe(0.005)
        itl.observe(0.0051)
        itl.observe(1e6)
        text = sim.metrics.render().decode()
        prefix = "vllm:inter_token_latency_seconds"
        self.assertIn(prefix + '_bucket{le="0.001",model_name="m"} 0.0', text)
        self.assertIn(prefix + '_bucket{le="0.005",model_name="m"} 1.0', text)
        self.assertIn(prefix + '_bucket{le="0.01",model_name="m"} 2.0', text)
        self.assertIn(prefix + '_bucket{le="10.0",model_name="m"} 2.0', text)
        self.assertIn(prefix + '_bucket{le="+Inf",model_name="m"} 3.0', text)
        self.assertIn(prefix + '_count{model_name="m"} 3.0', text)
        self.assertEqual(itl.count, 3)


class FaultSpecTests(SynchronousTestCase):
    """
    Fault specifications are validated, with errors naming the key.
    """

    def test_unknown_key_is_named(self) -> None:
        with self.assertRaises(FaultError) as raised:
            validate_faults({"status": 503, "explode": True})
        self.assertIn("explode", str(raised.exception))

    def test_bad_values(self) -> None:
        for spec in [
            {"status": "503"},
            {"status": 99},
            {"status": True},
            {"stall_seconds": -1},
            {"drop_after_chunks": 1.5},
            {"byte_writes": 1},
        ]:
            self.assertRaises(FaultError, validate_faults, spec)
        self.assertRaises(FaultError, validate_faults, [])

    def test_option_values_are_json(self) -> None:
        self.assertEqual(parse_fault_option("status=503"), ("status", 503))
        self.assertEqual(parse_fault_option("byte_writes=true"), ("byte_writes", True))
        self.assertEqual(
            parse_fault_option("stall_seconds=0.5"), ("stall_seconds", 0.5)
        )
        self.assertRaises(FaultError, parse_fault_option, "status")
        self.assertEqual(
            FAULT_KEYS,
            {
                "status",
                "stall_before_first_byte",
                "stall_after_chunks",
                "stall_seconds",
                "drop_after_chunks",
                "byte_writes",
            },
        )


class SchedulerTests(SynchronousTestCase):
    """
    Concurrency slots and the FIFO queue.
    """

    def test_fifo(self) -> None:
        """
        Requests beyond the slots wait and are admitted oldest first.
        """
        s = Scheduler(2, 10)
        self.assertIsNone(s.acquire())
        self.assertIsNone(s.acquire())
        order: list[int] = []
        waiters = [s.acquire() for _ in range(3)]
        for i, w in enumerate(waiters):
            assert w is not None
            w.addCallback(lambda _, i=i: order.append(i))
        self.assertEqual((s.running, s.waiting), (2, 3))
        s.release()
        self.assertEqual(order, [0])
        s.release()
        s.release()
        self.assertEqual(order, [0, 1, 2])
        self.assertEqual((s.running, s.waiting), (2, 0))

    def test_cancel_leaves_queue(self) -> None:
        """
        Cancelling a waiter takes it out of the queue; it fails with
        CancelledError and the next waiter gets the slot.
        """
        s = Scheduler(1, 10)
        s.acquire()
        first, second = s.acquire(), s.acquire()
        assert first is not None and second is not None
        first.cancel()
        self.failureResultOf(first, CancelledError)
        self.assertEqual(s.waiting, 1)
        s.release()
        self.successResultOf(second)
        self.assertEqual((s.running, s.waiting), (1, 0))

    def test_queue_full(self) -> None:
        s = Scheduler(1, 1)
        s.acquire()
        s.acquire()
        self.assertRaises(QueueFull, s.acquire)

    def test_synchronous_release_does_not_recurse(self) -> None:
        """
        Waiters that finish as soon as they are admitted hand their slot on
        without growing the stack.
        """
        s = Scheduler(1, 10_000)
        s.acquire()
        admitted = []
        for i in range(5000):
            w = s.acquire()
            assert w is not None
            w.addCallback(lambda _, i=i: (admitted.append(i), s.release()))
        s.release()
        self.assertEqual(len(admitted), 5000)
        self.assertEqual((s.running, s.waiting), (0, 0))


# ---------------------------------------------------------------------------
# The real site over an in-memory transport, under a Clock


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    """
    The body of a chunked response so far, and whether it is complete.
    """
    out = []
    while data:
        size_line, sep, rest = data.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0:
            return b"".join(out), True
        if len(rest) < size + 2:
            out.append(rest[:size])
            break
        out.append(rest[:size])
        data = rest[size + 2 :]
    return b"".join(out), False


class _Conn:
    """
    One client connection to a L{SimSite}, in memory.
    """

    def __init__(self, site: SimSite) -> None:
        self.transport = StringTransport()
        self.channel = cast(
            SimChannel, site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 4000))
        )
        self.channel.makeConnection(self.transport)

    def send(self, path: str, body: object = None, method: str = "POST") -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.channel.dataReceived(
            f"{method} {path} HTTP/1.1\r\nHost: sim\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )

    def head_body(self) -> tuple[bytes, bytes, bool]:
        raw = self.transport.value()
        head, sep, rest = raw.partition(b"\r\n\r\n")
        if not sep:
            return b"", b"", False
        if b"transfer-encoding: chunked" in head.lower():
            body, done = _dechunk(rest)
            return head, body, done
        return head, rest, True

    def events(self) -> list[bytes]:
        return [e for e in self.head_body()[1].split(b"\n\n") if e]

    def lose(self) -> None:
        self.channel.connectionLost(Failure(ConnectionDone()))


def _chat(max_tokens: int, stream: bool = True, **extra: object) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


class SiteTests(SynchronousTestCase):
    """
    The simulator's site over in-memory connections with a fake clock.
    """

    def make(self, **config: Any) -> tuple[Simulator, SimSite, Clock]:
        clock = Clock()
        clock.advance(1000)
        sim = Simulator(SimConfig(models=("m",), **config), clock)
        return sim, SimSite(sim), clock

    def assertClean(self, clock: Clock) -> None:
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_stream_timing(self) -> None:
        """
        Headers go out at once; the role chunk and first token after ttft;
        one token per itl; the tail with the last token.
        """
        sim, site, clock = self.make(ttft=1.0, itl=0.5)
        c = _Conn(site)
        c.send("/v1/chat/completions", _chat(3))
        head, _, _ = c.head_body()
        self.assertIn(b"200 OK", head)
        self.assertIn(b"text/event-stream", head.lower())
        self.assertIn(b"cache-control: no-cache", head.lower())
        self.assertEqual(c.events(), [])
        clock.advance(0.999)
        self.assertEqual(c.events(), [])
        clock.advance(0.001)
        self.assertEqual(len(c.events()), 2)
        clock.advance(0.5)
        self.assertEqual(len(c.events()), 3)
        self.assertEqual(sim.scheduler.running, 1)
        clock.advance(0.5)
        events = c.events()
        self.assertEqual(len(events), 6)
        self.assertEqual(events[-1], b"data: [DONE]")
        self.assertTrue(c.head_body()[2])
        self.assertEqual(sim.scheduler.running, 0)
        self.assertEqual(sim.stats.streams_completed, 1)
        c.lose()
        self.assertClean(clock)
        self.assertEqual(sim.stats.streams_cancelled, 0)

    def test_non_stream_waits_ttft_plus_itls(self) -> None:
        """
        A whole answer comes after ttft + (n - 1) * itl.
        """
        sim, site, clock = self.make(ttft=1.0, itl=0.5)
        c = _Conn(site)
        c.send("/v1/completions", {"model": "m", "prompt": "p", "max_tokens": 3})
        clock.advance(1.999)
        self.assertEqual(c.transport.value(), b"")
        clock.advance(0.001)
        head, body, done = c.head_body()
        self.assertTrue(done)
        answer = json.loads(body)
        self.assertEqual(answer["object"], "text_completion")
        self.assertEqual(answer["choices"][0]["text"], completion_text(b"p", 3))
        c.lose()
        self.assertClean(clock)

    def test_disconnect_stops_and_frees_slot(self) -> None:
        """
        A client leaving mid-stream cancels the pending call, is counted,
        and its slot goes to the next queued request.
        """
        sim, site, clock = self.make(ttft=0.0, itl=1.0, max_concurrency=1)
        a, b = _Conn(site), _Conn(site)
        a.send("/v1/chat/completions", _chat(100))
        b.send("/v1/chat/completions", _chat(2))
        self.assertEqual((sim.scheduler.running, sim.scheduler.waiting), (1, 1))
        self.assertEqual(len(a.events()), 2)
        self.assertEqual(b.events(), [])
        clock.advance(1)
        a.lose()
        stats = sim.stats_json()
        self.assertEqual(stats["streams_cancelled"], 1)
        self.assertEqual(stats["last_cancel_time"], 1001.0)
        self.assertEqual((stats["running"], stats["waiting"]), (1, 0))
        self.assertEqual(len(b.events()), 2)
        clock.advance(1)
        self.assertTrue(b.head_body()[2])
        self.assertEqual(sim.stats.streams_completed, 1)
        b.lose()
        self.assertClean(clock)

    def test_queued_client_leaves_queue(self) -> None:
        """
        A waiting request whose client goes away leaves the queue.
        """
        sim, site, clock = self.make(itl=1.0, max_concurrency=1)
        a, b = _Conn(site), _Conn(site)
        a.send("/v1/chat/completions", _chat(3))
        b.send("/v1/chat/completions", _chat(3, stream=False))
        self.assertEqual(sim.scheduler.waiting, 1)
        b.lose()
        self.assertEqual((sim.scheduler.running, sim.scheduler.waiting), (1, 0))
        self.assertEqual(sim.stats.requests_cancelled, 1)
        self.assertEqual(sim.stats.streams_cancelled, 0)
        clock.advance(1)
        clock.advance(1)
        self.assertTrue(a.head_body()[2])
        a.lose()
        self.assertClean(clock)

    def test_queue_full_is_503(self) -> None:
        sim, site, clock = self.make(itl=1.0, max_concurrency=1, max_queue=0)
        a, b = _Conn(site), _Conn(site)
        a.send("/v1/chat/completions", _chat(2))
        b.send("/v1/chat/completions", _chat(2))
        head, body, _ = b.head_body()
        self.assertIn(b"503", head.split(b"\r\n")[0])
        self.assertEqual(json.loads(body)["error"]["code"], "queue_full")
        clock.advance(1)
        a.lose()
        b.lose()
        self.assertClean(clock)

    def test_byte_writes(self) -> None:
        """
        Under byte_writes each write carries one byte, 2 ms apart, and the
        stream still decodes to the right completion.
        """
        sim, site, clock = self.make()
        c = _Conn(site)
        c.send(
            "/v1/completions",
            {**_chat(4), "prompt": "x", "llmgw_sim": {"byte_writes": True}},
        )
        sizes = []
        for _ in range(10):
            sizes.append(len(c.head_body()[1]))
            clock.advance(0.002)
        self.assertEqual(sizes, list(range(1, 11)))
        while not c.head_body()[2]:
            clock.advance(0.002)
        text = "".join(
            _event_json(e + b"\n\n")["choices"][0]["text"] for e in c.events()[:-1]
        )
        self.assertEqual(text, completion_text(b"x", 4))
        c.lose()
        self.assertClean(clock)

    def test_stall_before_first_byte(self) -> None:
        """
        Nothing at all, headers included, goes out during the stall; a
        forever stall leaves no delayed call, and ends with the client.
        """
        sim, site, clock = self.make()
        c = _Conn(site)
        c.send(
            "/v1/chat/completions", _chat(2, llmgw_sim={"stall_before_first_byte": 5})
        )
        clock.advance(4.9)
        self.assertEqual(c.transport.value(), b"")
        clock.advance(0.1)
        self.assertTrue(c.head_body()[2])
        c.lose()
        forever = _Conn(site)
        forever.send(
            "/v1/chat/completions", _chat(2, llmgw_sim={"stall_before_first_byte": 1e9})
        )
        clock.advance(3600)
        self.assertEqual(forever.transport.value(), b"")
        forever.lose()
        self.assertEqual(sim.stats.streams_cancelled, 1)
        self.assertEqual(sim.stats.streams_started, 1)
        self.assertClean(clock)

    def test_stall_after_chunks(self) -> None:
        sim, site, clock = self.make()
        c = _Conn(site)
        c.send(
            "/v1/chat/completions",
            _chat(3, llmgw_sim={"stall_after_chunks": 2, "stall_seconds": 3}),
        )
        self.assertEqual(len(c.events()), 2)
        clock.advance(2.9)
        self.assertEqual(len(c.events()), 2)
        clock.advance(0.1)
        self.assertEqual(len(c.events()), 6)
        c.lose()
        self.assertClean(clock)

    def test_drop_after_chunks(self) -> None:
        """
        drop_after_chunks aborts the connection after N events, unfinished.
        """
        sim, site, clock = self.make(itl=0.1)
        c = _Conn(site)
        c.send("/v1/chat/completions", _chat(5, llmgw_sim={"drop_after_chunks": 3}))
        clock.advance(0.1)
        self.assertEqual(len(c.events()), 3)
        self.assertFalse(c.transport.disconnected)
        self.assertEqual(sim.scheduler.running, 0)
        clock.advance(DROP_DELAY)
        self.assertEqual(len(c.events()), 3)
        self.assertTrue(c.transport.disconnected)
        self.assertFalse(c.head_body()[2])
        self.assertEqual(sim.scheduler.running, 0)
        c.lose()
        self.assertEqual(sim.stats.streams_dropped, 1)
        self.assertEqual(sim.stats.streams_cancelled, 0)
        self.assertClean(clock)

    def test_process_faults_and_per_request_override(self) -> None:
        """
        POST /sim/fault sets process-wide faults, a request's own keys win,
        and an empty object clears them.
        """
        sim, site, clock = self.make()
        c = _Conn(site)
        c.send("/sim/fault", {"status": 500})
        self.assertEqual(json.loads(c.head_body()[1]), {"status": 500})
        for body, status in [
            (_chat(1, stream=False), b"500"),
            (_chat(1, stream=False, llmgw_sim={"status": 429}), b"429"),
        ]:
            r = _Conn(site)
            r.send("/v1/chat/completions", body)
            head, err, _ = r.head_body()
            self.assertIn(status, head.split(b"\r\n")[0])
            self.assertIn("message", json.loads(err)["error"])
            r.lose()
        c2 = _Conn(site)
        c2.send("/sim/fault", {})
        self.assertEqual(sim.faults, {})
        c.lose()
        c2.lose()
        self.assertClean(clock)


# ---------------------------------------------------------------------------
# A real listening port


async def _wait_for(
    predicate: Callable[[], bool], timeout: float = 10.0, step: float = 0.01
) -> None:
    waited = 0.0
    while not predicate():
        if waited > timeout:
            raise AssertionError("condition not reached")
        await deferLater(reactor, step, lambda: None)
        waited += step


class _Raw(Protocol):
    """
    A raw HTTP client: sends one request, collects bytes, optionally aborts
    once C{abort_after} bytes arrived.
    """

    def __init__(self, request: bytes, abort_after: int | None = None) -> None:
        self.request = request
        self.abort_after = abort_after
        self.data = b""
        self.done: Deferred[bytes] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(self.request)

    def dataReceived(self, data: bytes) -> None:
        self.data += data
        if self.abort_after is not None and len(self.data) >= self.abort_after:
            self.abort_after = None
            assert self.transport is not None
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.done.callback(self.data)


class ListeningTests(TestCase):
    """
    The simulator on a real port, through treq and raw sockets.
    """

    timeout = 30

    def setUp(self) -> None:
        self.start()

    def start(self, **config: Any) -> None:
        self.sim = Simulator(SimConfig(models=("m", "other"), **config), reactor)
        self.port = reactor.listenTCP(0, SimSite(self.sim), interface="127.0.0.1")
        self.base = f"http://127.0.0.1:{self.port.getHost().port}"
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.stopped = False
        self.addCleanup(self.stop)

    async def _stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        await self.pool.closeCachedConnections()
        await _wait_for(lambda: self.sim.stats.connections_open == 0)
        await self.port.stopListening()

    def stop(self) -> Deferred[None]:
        return ensureDeferred(self._stop())

    async def post(self, path: str, body: object) -> tuple[int, Any]:
        response = await treq.post(
            self.base + path, json=body, pool=self.pool, unbuffered=True
        )
        return response.code, await response.json()

    async def get(self, path: str) -> tuple[int, bytes]:
        response = await treq.get(self.base + path, pool=self.pool)
        return response.code, await response.content()

    async def raw(self, request: bytes, abort_after: int | None = None) -> bytes:
        proto = _Raw(request, abort_after)
        factory = ClientFactory.forProtocol(lambda: proto)
        reactor.connectTCP("127.0.0.1", self.port.getHost().port, factory)
        return await proto.done

    def test_chat_non_stream(self) -> Deferred[None]:
        async def go() -> None:
            code, answer = await self.post(
                "/v1/chat/completions",
                {"model": "m", "messages": [{"role": "user", "content": "hi there"}]},
            )
            self.assertEqual(code, 200)
            self.assertEqual(answer["object"], "chat.completion")
            self.assertEqual(answer["model"], "m")
            message = answer["choices"][0]["message"]
            self.assertEqual(message["role"], "assistant")
            self.assertEqual(message["content"], completion_text(b"hi there", 16))
            self.assertEqual(answer["choices"][0]["finish_reason"], "length")
            self.assertEqual(
                answer["usage"],
                {"prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18},
            )

        return ensureDeferred(go())

    def test_stream_with_usage(self) -> Deferred[None]:
        """
        A streamed chat, parsed as SSE: role chunk, tokens, finish chunk,
        usage-only chunk, [DONE]; every other chunk has usage null.
        """

        async def go() -> None:
            response = await treq.post(
                self.base + "/v1/chat/completions",
                json=_chat(5, model="other", stream_options={"include_usage": True}),
                pool=self.pool,
                unbuffered=True,
            )
            self.assertEqual(
                response.headers.getRawHeaders(b"content-type"), [b"text/event-stream"]
            )
            self.assertEqual(
                response.headers.getRawHeaders(b"cache-control"), [b"no-cache"]
            )
            body = await response.content()
            events = body.split(b"\n\n")
            self.assertEqual(events[-2:], [b"data: [DONE]", b""])
            chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
            self.assertEqual(
                chunks[0]["choices"][0]["delta"], {"role": "assistant", "content": ""}
            )
            self.assertEqual(
                "".join(
                    c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]
                ),
                completion_text(b"hello", 5),
            )
            self.assertEqual(chunks[-2]["choices"][0]["finish_reason"], "length")
            self.assertEqual(chunks[-1]["choices"], [])
            self.assertEqual(
                chunks[-1]["usage"],
                {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6},
            )
            self.assertTrue(all(c["usage"] is None for c in chunks[:-1]))
            self.assertTrue(all(c["model"] == "other" for c in chunks))
            self.assertTrue(all(c["object"] == "chat.completion.chunk" for c in chunks))
            self.assertEqual(len({c["id"] for c in chunks}), 1)

        return ensureDeferred(go())

    def test_embeddings_models_health(self) -> Deferred[None]:
        async def go() -> None:
            code, answer = await self.post(
                "/v1/embeddings", {"model": "m", "input": ["a", "b c"]}
            )
            self.assertEqual(code, 200)
            self.assertEqual(answer["object"], "list")
            self.assertEqual([d["index"] for d in answer["data"]], [0, 1])
            self.assertEqual(len(answer["data"][0]["embedding"]), 16)
            self.assertEqual(answer["usage"], {"prompt_tokens": 3, "total_tokens": 3})
            code, body = await self.get("/v1/models")
            models = json.loads(body)
            self.assertEqual([m["id"] for m in models["data"]], ["m", "other"])
            self.assertEqual(models["data"][0]["owned_by"], "llmgw-sim")
            code, body = await self.get("/health")
            self.assertEqual(code, 200)

        return ensureDeferred(go())

    def test_errors(self) -> Deferred[None]:
        """
        Unknown model: 404 model_not_found; bad JSON: 400; a status fault:
        that status; an unknown fault key: 400 naming it.
        """

        async def go() -> None:
            code, answer = await self.post(
                "/v1/chat/completions", _chat(1, model="nope", stream=False)
            )
            self.assertEqual(code, 404)
            self.assertEqual(answer["error"]["code"], "model_not_found")
            self.assertEqual(set(answer["error"]), {"message", "type", "param", "code"})
            response = await treq.post(
                self.base + "/v1/completions", data=b"{nope", pool=self.pool
            )
            self.assertEqual(response.code, 400)
            self.assertIn("error", await response.json())
            code, answer = await self.post(
                "/v1/chat/completions", _chat(1, llmgw_sim={"status": 503})
            )
            self.assertEqual(code, 503)
            self.assertEqual(answer["error"]["type"], "server_error")
            code, answer = await self.post(
                "/v1/chat/completions", _chat(1, llmgw_sim={"frobnicate": 1})
            )
            self.assertEqual(code, 400)
            self.assertIn("frobnicate", answer["error"]["message"])
            code, answer = await self.post("/sim/fault", {"frobnicate": 1})
            self.assertEqual(code, 400)
            self.assertEqual(self.sim.stats.streams_started, 0)

        return ensureDeferred(go())

    def test_drop_after_chunks(self) -> Deferred[None]:
        """
        The client sees the connection end after N events, unfinished.
        """

        async def go() -> None:
            body = json.dumps(_chat(10, llmgw_sim={"drop_after_chunks": 3})).encode()
            data = await self.raw(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            _, _, rest = data.partition(b"\r\n\r\n")
            payload, complete = _dechunk(rest)
            self.assertFalse(complete)
            self.assertEqual(payload.count(b"data: "), 3)
            self.assertEqual(self.sim.stats.streams_dropped, 1)
            self.assertEqual(self.sim.scheduler.running, 0)

        return ensureDeferred(go())

    def test_client_disconnect_counted(self) -> Deferred[None]:
        """
        A client leaving mid-stream is counted in streams_cancelled, with
        last_cancel_time, and frees its slot.
        """

        async def go() -> None:
            await self.stop()
            self.start(itl=0.02)
            body = json.dumps(_chat(10_000)).encode()
            before = reactor.seconds()
            await self.raw(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body,
                abort_after=1000,
            )
            await _wait_for(lambda: self.sim.stats.streams_cancelled == 1)
            code, raw = await self.get("/sim/stats")
            stats = json.loads(raw)
            self.assertEqual(stats["streams_started"], 1)
            self.assertEqual(stats["streams_completed"], 0)
            self.assertEqual(stats["running"], 0)
            self.assertGreaterEqual(stats["last_cancel_time"], before)
            code, raw = await self.post("/sim/stats/reset", {})
            self.assertEqual(raw["streams_cancelled"], 0)
            self.assertIsNone(raw["last_cancel_time"])

        return ensureDeferred(go())

    def test_queueing_visible(self) -> Deferred[None]:
        """
        With one slot, a second request waits, as /sim/stats and /metrics
        show, and runs when the first ends.
        """

        async def go() -> None:
            await self.stop()
            self.start(itl=0.02, max_concurrency=1)
            first = ensureDeferred(
                self.post(
                    "/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 20}
                )
            )
            second = ensureDeferred(
                self.post(
                    "/v1/completions", {"model": "m", "prompt": "b", "max_tokens": 2}
                )
            )
            await _wait_for(lambda: self.sim.scheduler.waiting == 1)
            code, raw = await self.get("/sim/stats")
            stats = json.loads(raw)
            self.assertEqual((stats["running"], stats["waiting"]), (1, 1))
            code, metrics = await self.get("/metrics")
            self.assertIn(b'vllm:num_requests_running{model_name="m"} 1.0', metrics)
            self.assertIn(b'vllm:num_requests_waiting{model_name="m"} 1.0', metrics)
            self.assertIn(b'vllm:kv_cache_usage_perc{model_name="m"} 1.0', metrics)
            (c1, _), (c2, a2) = await first, await second
            self.assertEqual((c1, c2), (200, 200))
            self.assertEqual(a2["choices"][0]["text"], completion_text(b"b", 2))
            code, metrics = await self.get("/metrics")
            self.assertIn(
                b"vllm:request_success_total"
                b'{finished_reason="length",model_name="m"} 2.0',
                metrics,
            )
            self.assertIn(b'vllm:generation_tokens_total{model_name="m"} 22.0', metrics)
            self.assertIn(b"vllm:e2e_request_latency_seconds_count", metrics)
            self.assertIn(b"vllm:time_to_first_token_seconds_count", metrics)
            self.assertIn(b"vllm:inter_token_latency_seconds_count", metrics)
            self.assertIn(b"vllm:prompt_tokens_total", metrics)

        return ensureDeferred(go())

    def test_byte_writes_split_characters(self) -> Deferred[None]:
        """
        Under byte_writes the stream arrives in many pieces, some splitting
        a UTF-8 character, and still decodes to the completion.
        """

        async def go() -> None:
            response = await treq.post(
                self.base + "/v1/chat/completions",
                json=_chat(6, llmgw_sim={"byte_writes": True}),
                pool=self.pool,
                unbuffered=True,
            )
            pieces: list[bytes] = []
            await treq.collect(response, pieces.append)
            body = b"".join(pieces)
            self.assertGreater(len(pieces), 10)
            text = "".join(
                json.loads(e.removeprefix(b"data: "))["choices"][0]["delta"].get(
                    "content", ""
                )
                for e in body.split(b"\n\n")[:-2]
            )
            self.assertEqual(text, completion_text(b"hello", 6))
            self.assertTrue(any(len(t.encode()) > len(t) for t in text))

        return ensureDeferred(go())


class _Child(ProcessProtocol):
    def __init__(self) -> None:
        self.out = b""
        self.err = b""
        self.listening: Deferred[str] = Deferred()
        self.ended: Deferred[BaseException] = Deferred()

    def outReceived(self, data: bytes) -> None:
        self.out += data
        if b"\n" in self.out and not self.listening.called:
            self.listening.callback(self.out.split(b"\n", 1)[0].decode())

    def errReceived(self, data: bytes) -> None:
        self.err += data

    def processEnded(self, reason: Failure) -> None:
        if not self.listening.called:
            self.listening.errback(reason)
        self.ended.callback(reason.value)


class ChildProcessTests(TestCase):
    """
    C{llmgw sim} as a user runs it, driven by the official openai client.
    """

    timeout = 60

    def test_openai_client_against_child(self) -> Deferred[None]:
        async def go() -> None:
            child = _Child()
            env = dict(os.environ)
            env["PYTHONUNBUFFERED"] = "1"
            process = reactor.spawnProcess(
                child,
                sys.executable,
                [
                    sys.executable,
                    "-m",
                    "llmgw.cli.main",
                    "sim",
                    "--port",
                    "0",
                    "--model",
                    "m",
                ],
                env=env,
            )
            try:
                line = await child.listening
                prefix = "llmgw sim listening on "
                self.assertTrue(line.startswith(prefix), line)
                url = line[len(prefix) :]

                def call() -> tuple[str, list[str]]:
                    from openai import OpenAI

                    client = OpenAI(
                        base_url=url + "/v1", api_key="x", max_retries=0, timeout=10
                    )
                    try:
                        whole = client.chat.completions.create(
                            model="m",
                            messages=[{"role": "user", "content": "hello"}],
                            max_tokens=4,
                        )
                        pieces = []
                        for chunk in client.chat.completions.create(
                            model="m",
                            messages=[{"role": "user", "content": "hello"}],
                            max_tokens=4,
                            stream=True,
                            extra_body={"llmgw_sim": {"byte_writes": True}},
                        ):
                            if chunk.choices and chunk.choices[0].delta.content:
                                pieces.append(chunk.choices[0].delta.content)
                        return whole.choices[0].message.content or "", pieces
                    finally:
                        client.close()

                whole, pieces = await deferToThread(call)
                self.assertEqual(whole, completion_text(b"hello", 4))
                self.assertEqual("".join(pieces), whole)
            finally:
                if process.pid is not None:
                    process.signalProcess("TERM")
                reason = await child.ended
            self.assertIsInstance(reason, (ProcessDone, ProcessTerminated))
            self.assertEqual(getattr(reason, "exitCode", None), 0, child.err)

        return ensureDeferred(go())
