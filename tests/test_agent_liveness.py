"""
L{llmgw.agent.liveness}: what a ready engine says of itself, asked every
second; the proof that the agent started an engine
(L{llmgw.agent.records.proven}); and the router's reading of vLLM's
engine-dead answer (L{llmgw.router.api.failures.engine_dead}).  The engine
is a fake HTTP client here; C{tests.test_e2e_engine_truth} runs the sim
through a real agent, C{tests.test_e2e_vllm_engine_truth} the real vLLM.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, cast

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionRefusedError, DNSLookupError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import PartialDownloadError
from twisted.web.iweb import IAgent

from llmgw.agent import liveness, sleep
from llmgw.agent.liveness import INTERVAL, REFUSED_DEAD, Liveness, engine_line
from llmgw.agent.records import Marked, proven, tail, write_proof
from llmgw.agent.sleep import EngineRoutes
from llmgw.reactors import IEngineReactor
from llmgw.router.api.failures import engine_dead
from llmgw.sim.core import engine_dead_body
from llmgw.wire import agent_pb2 as pb


@dataclass
class _Answer:
    code: int
    body: bytes = b""


class _Engine:
    """
    Answers C{/health} with C{health} and C{/is_sleeping} with
    C{sleeping}, or 404 when it is L{None}.
    """

    def __init__(self) -> None:
        self.health = 200
        self.sleeping: bool | None = False
        self.asked: list[str] = []
        # An answer to /is_sleeping held until the test fires it.
        self.held: Deferred[Any] | None = None
        # No listener on its port: every connection refused.
        self.refusing = False
        # Every question fails with this, when set.
        self.failing: Exception | None = None

    def request(self, method: bytes, url: bytes, *rest: object) -> Deferred[Any]:
        path = "/" + url.decode().split("/", 3)[3]
        self.asked.append(path)
        if self.refusing:
            return fail(ConnectionRefusedError("Connection refused"))
        if self.failing is not None:
            return fail(self.failing)
        if path == "/health":
            return succeed(_Answer(self.health))
        if path == "/is_sleeping":
            if self.held is not None:
                return self.held
            if self.sleeping is None:
                return succeed(_Answer(404, b'{"detail":"Not Found"}'))
            return succeed(
                _Answer(200, json.dumps({"is_sleeping": self.sleeping}).encode())
            )
        return fail(ConnectionError(path))


@dataclass
class _Shard:
    id: str = "s1"
    command: pb.StartShard = field(
        default_factory=lambda: pb.StartShard(shard_id="s1", engine="vllm", port=18200)
    )
    state: int = pb.SHARD_STATE_READY
    busy: bool = False
    stopping: bool = False
    log_lines: list[str] = field(default_factory=list)


class LivenessTests(SynchronousTestCase):
    def setUp(self) -> None:
        for module in (liveness, sleep):
            self.patch(module, "readBody", lambda answer: succeed(answer.body))
        self.clock = Clock()
        self.engine = _Engine()
        self.shard = _Shard()
        self.dead: list[str] = []
        self.asleep: list[bool] = []
        http = cast(IAgent, self.engine)
        self.liveness = Liveness(
            self.shard,
            cast(IEngineReactor, self.clock),
            http,
            "http://127.0.0.1:18200/health",
            {},
            lambda: EngineRoutes(http, self.clock, self.shard.command, "127.0.0.1", {}),
            self.dead.append,
            lambda: self.asleep.append(True),
        )
        self.liveness.start()
        self.addCleanup(self.liveness.stop)

    def test_healthy_awake(self) -> None:
        """
        An engine that answers 200 and awake is asked both every second,
        and nothing happens.
        """
        for _ in range(3):
            self.clock.advance(INTERVAL)
        self.assertEqual(self.engine.asked, ["/health", "/is_sleeping"] * 3)
        self.assertEqual((self.dead, self.asleep), ([], []))

    def test_health_503_is_death(self) -> None:
        """
        C{/health} 503: dead, with the engine's own line from its output,
        and asked no more.
        """
        self.shard.log_lines = [
            "(APIServer pid=7) WARNING 12-05 12:41:30 [core_client.py:817]"
            " [shutdown] MPClient: engine core exited unexpectedly; starting"
            " cleanup",
            "(APIServer pid=7) ERROR 12-05 12:41:30 [async_llm.py:906]"
            " vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered"
            " an issue. See stack trace (above) for the root cause.",
            "INFO Shutting down",
        ]
        self.engine.health = 503
        self.clock.advance(INTERVAL)
        self.assertEqual(len(self.dead), 1)
        self.assertIn(
            "[async_llm.py:906] vllm.v1.engine.exceptions.EngineDead", self.dead[0]
        )
        self.clock.advance(INTERVAL * 3)
        self.assertEqual(self.engine.asked, ["/health"])

    def test_port_refused_is_death(self) -> None:
        """
        A ready engine whose port refuses connections (vLLM's server after
        its engine core died, its end waiting for ever on a utility call
        in flight, its process alive): dead after L{REFUSED_DEAD} refusals
        in a row, with the engine's own line, and asked no more.
        """
        self.shard.log_lines = [
            "WARNING [core_client.py:817] [shutdown] MPClient: engine core"
            " exited unexpectedly; starting cleanup",
            "INFO Shutting down",
            "INFO Waiting for connections to close.",
        ]
        self.engine.refusing = True
        for _ in range(REFUSED_DEAD - 1):
            self.clock.advance(INTERVAL)
        self.assertEqual(self.dead, [])
        self.clock.advance(INTERVAL)
        self.assertEqual(len(self.dead), 1)
        self.assertIn("engine core exited unexpectedly", self.dead[0])
        asked = len(self.engine.asked)
        self.clock.advance(INTERVAL * 3)
        self.assertEqual(self.engine.asked.count("/health"), REFUSED_DEAD)
        self.assertEqual(len(self.engine.asked), asked)

    def test_hung_question_holds_no_other(self) -> None:
        """
        An C{/is_sleeping} that is never answered (vLLM's, sent as its
        engine core died) holds up no health question: the 503 that
        follows is seen at the next tick, not once the hung one is dropped
        (L{liveness.ASK_TIMEOUT}, about when vLLM ends itself).
        """
        self.engine.held = Deferred()
        self.clock.advance(INTERVAL)
        self.engine.health = 503
        self.clock.advance(INTERVAL)
        self.assertEqual(len(self.dead), 1)
        self.assertEqual(self.engine.asked, ["/health", "/is_sleeping", "/health"])

    def test_refusals_in_a_row_only(self) -> None:
        """
        Refusals broken by an answer start again from none; refusals while
        the agent stops the engine do not count; with nothing in the
        output, the refusals are the line.
        """
        self.engine.refusing = True
        for _ in range(REFUSED_DEAD - 1):
            self.clock.advance(INTERVAL)
        self.engine.refusing = False
        self.clock.advance(INTERVAL)
        self.engine.refusing = True
        for _ in range(REFUSED_DEAD - 1):
            self.clock.advance(INTERVAL)
        self.shard.busy = self.shard.stopping = True
        self.clock.advance(INTERVAL)
        self.shard.busy = self.shard.stopping = False
        for _ in range(REFUSED_DEAD - 1):
            self.clock.advance(INTERVAL)
        self.assertEqual(self.dead, [])
        self.clock.advance(INTERVAL)
        self.assertEqual(len(self.dead), 1)
        self.assertIn(
            f"refused connections on its port {REFUSED_DEAD} times", self.dead[0]
        )

    def test_asleep_outside(self) -> None:
        """
        C{/is_sleeping} true while the agent turns nothing: asleep, once.
        """
        self.engine.sleeping = True
        self.clock.advance(INTERVAL)
        self.clock.advance(INTERVAL)
        self.assertEqual(self.asleep, [True])

    def test_no_answer_says_nothing(self) -> None:
        """
        A question with no answer (the node's name not resolved, a body
        cut short) says nothing and logs nothing; one that fails for a
        reason of the agent's own is logged.
        """
        for failure in (DNSLookupError("gpu-01.example"), PartialDownloadError(b"200")):
            self.engine.failing = failure
            self.clock.advance(INTERVAL)
        self.assertEqual((self.dead, self.asleep), ([], []))
        self.assertEqual(self.flushLoggedErrors(), [])
        self.engine.failing = KeyError("a fault of the agent's")
        self.clock.advance(INTERVAL)
        # The health question's (the sleep routes tell any failure to
        # reach the engine as their own refusal, L{CommandRefused}).
        self.assertEqual(len(self.flushLoggedErrors(KeyError)), 1)

    def test_agents_own_stop(self) -> None:
        """
        While the agent stops the engine, its answers are the agent's
        doing: nothing happens.
        """
        self.shard.busy = self.shard.stopping = True
        self.engine.sleeping = True
        self.engine.health = 503
        self.clock.advance(INTERVAL)
        self.assertEqual((self.dead, self.asleep), ([], []))

    def test_agents_own_turn(self) -> None:
        """
        While the agent itself puts the engine to sleep or wakes it, its
        sleeping is the agent's doing, but a 503 is still its death: vLLM's
        sleep or wake sent as its engine core died would never answer.
        """
        self.shard.busy = True
        self.engine.sleeping = True
        self.clock.advance(INTERVAL)
        self.assertEqual((self.dead, self.asleep), ([], []))
        self.engine.health = 503
        self.clock.advance(INTERVAL)
        self.assertEqual((len(self.dead), self.asleep), (1, []))

    def test_asleep_and_waking_watched(self) -> None:
        """
        Sleeping or waking, an engine's health is asked (whether it sleeps
        is not): a 503 is its death, so are refusals in a row.
        """
        for state in (pb.SHARD_STATE_SLEEPING, pb.SHARD_STATE_WAKING):
            self.setUp()
            self.shard.state = state
            self.engine.sleeping = True
            self.engine.health = 503
            self.clock.advance(INTERVAL)
            self.assertEqual((len(self.dead), self.asleep), (1, []), state)
            self.assertEqual(self.engine.asked, ["/health"], state)
            self.setUp()
            self.shard.state = state
            self.engine.refusing = True
            for _ in range(REFUSED_DEAD):
                self.clock.advance(INTERVAL)
            self.assertEqual(len(self.dead), 1, state)

    def test_answer_from_before_a_turn(self) -> None:
        """
        An answer sent before the agent's own sleep and wake (the asking
        stopped and started again meanwhile) does not count.
        """
        self.engine.held = Deferred()
        self.clock.advance(INTERVAL)
        self.liveness.stop()
        self.liveness.start()
        self.engine.held.callback(_Answer(200, b'{"is_sleeping": true}'))
        self.assertEqual(self.asleep, [])

    def test_no_sleep_route(self) -> None:
        """
        An engine without the route (vLLM without VLLM_SERVER_DEV_MODE) is
        asked once, then only its health.
        """
        self.engine.sleeping = None
        for _ in range(3):
            self.clock.advance(INTERVAL)
        self.assertEqual(self.engine.asked.count("/is_sleeping"), 1)
        self.assertEqual(self.engine.asked.count("/health"), 3)

    def test_engine_line_fallback(self) -> None:
        """
        Without a line of the engine naming its death, the fallback; with
        only vLLM's monitor warning, that.
        """
        self.assertEqual(engine_line(["INFO x"], "fallback"), "fallback")
        warning = (
            "WARNING [core_client.py:817] [shutdown] MPClient: engine core exited"
            " unexpectedly"
        )
        self.assertEqual(engine_line([warning, "INFO y"], "f"), warning)

    def test_engine_line_is_the_engines(self) -> None:
        """
        A request's log line quoting the words (vLLM's
        C{--enable-log-requests} logs prompts) is not the engine's line; a
        worker's death is; a long line is cut.
        """
        prompt = (
            "INFO [logger.py:43] Received request chatcmpl-1: prompt: 'Why does"
            " vllm.v1.engine.exceptions.EngineDeadError: happen? my laptop died"
            " unexpectedly, and the engine core exited unexpectedly'"
        )
        self.assertEqual(engine_line([prompt], "f"), "f")
        worker = (
            "ERROR [multiproc_executor.py:316] Worker proc VllmWorker-0 died"
            " unexpectedly (exit code: -9), shutting down executor."
        )
        self.assertEqual(engine_line([worker, prompt], "f"), worker)
        long = (
            "ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
            + ("x" * 5000)
        )
        self.assertEqual(len(engine_line([long], "f")), liveness.LINE_LIMIT)


class TailTests(SynchronousTestCase):
    def test_whole_lines(self) -> None:
        """
        A log longer than the 64 KiB read: its lines whole from the first
        line that begins inside the window (none cut at the front, none
        with a character cut), all of them for C{lines=None}.
        """
        path = self.mktemp()
        line = "é" * 99 + "\n"  # 199 bytes
        with open(path, "w", encoding="utf-8") as f:
            f.write(line * 400)
        found = tail(path, lines=None)
        self.assertEqual(found, [line[:-1]] * (65536 // len(line.encode())))
        self.assertEqual(tail(path), [line[:-1]] * 50)

    def test_probe_lines_left_out(self) -> None:
        """
        The access lines of the agent's own questions (uvicorn's, as vLLM
        0.32 printed them under the agent, two a second) are left out, so
        the last lines are what the engine said; a client's request's line
        and a line that only mentions a probe path stay.
        """
        path = self.mktemp()
        said = [
            "(APIServer pid=7) ERROR 12-05 14:01:02 [core.py:910] EngineCore died",
            'INFO:     10.0.0.9:5120 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
            "WARNING: GET /health is slow",
        ]
        probes = [
            'INFO:     127.0.0.1:39352 - "GET /health HTTP/1.1" 200 OK',
            '(APIServer pid=7) INFO:     127.0.0.1:39354 - "GET /is_sleeping'
            ' HTTP/1.1" 200 OK',
            'INFO:     127.0.0.1:39356 - "GET /metrics HTTP/1.1" 200 OK',
            'INFO:     127.0.0.1:39358 - "GET /v1/models?x=1 HTTP/1.1" 503',
        ]
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join([said[0], *probes * 20, *said[1:], *probes * 20]))
        self.assertEqual(tail(path), said)
        self.assertEqual(tail(path, lines=None), said)


class ProofTests(SynchronousTestCase):
    def test_proof_names_the_process(self) -> None:
        """
        A marked process is the agent's only with its proof's secret, pid
        and start time; a copy of the marker elsewhere (another pid or
        start time), a wrong secret, or no proof is not.
        """
        path = os.path.join(tempfile.mkdtemp(), "s1.proof")
        engine = Marked(100, 5000, {}, "secret-1")
        self.assertIn("no proof", proven(path, engine))
        write_proof(path, "secret-1", 100, 5000)
        self.assertEqual(proven(path, engine), "")
        self.assertIn(
            "not this process", proven(path, Marked(101, 5000, {}, "secret-1"))
        )
        self.assertIn(
            "not this process", proven(path, Marked(100, 5001, {}, "secret-1"))
        )
        self.assertIn("secret", proven(path, Marked(100, 5000, {}, "secret-2")))
        self.assertIn("secret", proven(path, Marked(100, 5000, {}, "")))
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)


class EngineDeadTests(SynchronousTestCase):
    def test_vllm_engine_dead_answer(self) -> None:
        """
        vLLM's 500 for a dead engine (as the sim gives it) is the engine's
        death; another 500, or that message with another status, is not.
        """
        self.assertTrue(engine_dead(500, engine_dead_body()))
        self.assertFalse(engine_dead(500, b'{"error": {"message": "boom"}}'))
        self.assertFalse(engine_dead(400, engine_dead_body()))
