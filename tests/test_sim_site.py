"""
Tests for L{llmgw.sim}: the real L{SimSite} fed bytes through a
L{StringTransport} under a L{Clock} (exact timing, disconnects, faults).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.sim.api import (
    completion_text,
)
from llmgw.sim.engine import (
    SimConfig,
    Simulator,
)
from llmgw.sim.exchange import DROP_DELAY
from llmgw.sim.web import SimSite
from tests.sim_support import chat_body, dechunk, event_json

reactor: Any = _reactor


# ---------------------------------------------------------------------------
# The real site over an in-memory transport, under a Clock


class _Conn:
    """
    One client connection to a L{SimSite}, in memory.
    """

    def __init__(self, site: SimSite) -> None:
        self.transport = StringTransport()
        self.channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 4000))
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
            body, done = dechunk(rest)
            return head, body, done
        return head, rest, True

    def events(self) -> list[bytes]:
        return [e for e in self.head_body()[1].split(b"\n\n") if e]

    def lose(self) -> None:
        self.channel.connectionLost(Failure(ConnectionDone()))


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
        c.send("/v1/chat/completions", chat_body(3))
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
        a.send("/v1/chat/completions", chat_body(100))
        b.send("/v1/chat/completions", chat_body(2))
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
        a.send("/v1/chat/completions", chat_body(3))
        b.send("/v1/chat/completions", chat_body(3, stream=False))
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
        a.send("/v1/chat/completions", chat_body(2))
        b.send("/v1/chat/completions", chat_body(2))
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
            {**chat_body(4), "prompt": "x", "llmgw_sim": {"byte_writes": True}},
        )
        sizes = []
        for _ in range(10):
            sizes.append(len(c.head_body()[1]))
            clock.advance(0.002)
        self.assertEqual(sizes, list(range(1, 11)))
        while not c.head_body()[2]:
            clock.advance(0.002)
        text = "".join(
            event_json(e + b"\n\n")["choices"][0]["text"] for e in c.events()[:-1]
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
            "/v1/chat/completions",
            chat_body(2, llmgw_sim={"stall_before_first_byte": 5}),
        )
        clock.advance(4.9)
        self.assertEqual(c.transport.value(), b"")
        clock.advance(0.1)
        self.assertTrue(c.head_body()[2])
        c.lose()
        forever = _Conn(site)
        forever.send(
            "/v1/chat/completions",
            chat_body(2, llmgw_sim={"stall_before_first_byte": 1e9}),
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
            chat_body(3, llmgw_sim={"stall_after_chunks": 2, "stall_seconds": 3}),
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
        c.send("/v1/chat/completions", chat_body(5, llmgw_sim={"drop_after_chunks": 3}))
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
            (chat_body(1, stream=False), b"500"),
            (chat_body(1, stream=False, llmgw_sim={"status": 429}), b"429"),
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
