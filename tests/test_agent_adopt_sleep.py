"""
L{llmgw.agent.turns.Turns}'s check as L{Supervisor.take} starts it for an
engine in sleep mode a restarted agent adopts: a wake waits for the check
to put the engine back to sleep, its GPUs count as held meanwhile, and a
stop during the check reports no C{ready}.  The engine is a fake here (an
HTTP client answering the sim's routes; C{test_e2e_sleep} runs the real
sim through a real agent).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, cast

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import Agent

from llmgw.agent import liveness, sleep
from llmgw.agent.engines import CommandRefused, build
from llmgw.agent.records import process_start_time
from llmgw.agent.supervisor import Supervisor
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb


class _Answer:
    def __init__(self, body: bytes, code: int = 200) -> None:
        self.body = body
        self.code = code


class _Engine:
    """
    The sim's sleep routes; C{hold} names a path whose answer waits for
    the test (L{release}).
    """

    def __init__(self, sleeping: bool) -> None:
        self.sleeping = sleeping
        self.asked: list[str] = []
        self.hold = ""
        self.held: Deferred[Any] | None = None
        # Answers to /is_sleeping left before a turn already under way ends.
        self.turn_in = 0
        # Which questions to /is_sleeping (1 the first) go unanswered.
        self.lost: set[int] = set()
        self.questions = 0
        # What its /metrics says (vLLM's sleep-state gauge, or nothing).
        self.metrics = b""
        # Its /health status: 503 once its engine core is dead.
        self.health = 200

    def request(self, method: bytes, url: bytes, *rest: object) -> Deferred[Any]:
        path = "/" + url.decode().split("/", 3)[3]
        self.asked.append(path)
        if path.startswith("/sleep"):
            answer = self._answer(path, lambda: setattr(self, "sleeping", True))
        elif path in ("/wake_up", "/wake_up?tags=kv_cache"):
            answer = self._answer(path, lambda: setattr(self, "sleeping", False))
        elif path in ("/wake_up?tags=weights", "/collective_rpc"):
            answer = self._answer(path, lambda: None)
        elif path == "/metrics":
            return succeed(_Answer(self.metrics))
        elif path == "/health":
            # Asked by the shard's liveness while it is ready, asleep or
            # waking.
            return succeed(_Answer(b"", self.health))
        else:
            self.questions += 1
            if self.questions in self.lost:
                return fail(ConnectionError("connection reset"))
            answer = self._answer(path, lambda: None, {"is_sleeping": self.sleeping})
            if self.turn_in:
                self.turn_in -= 1
                if not self.turn_in:
                    self.sleeping = not self.sleeping
        return answer

    def _answer(self, path: str, effect: Any, body: object = None) -> Deferred[Any]:
        def done(_: object) -> _Answer:
            effect()
            return _Answer(json.dumps(body).encode() if body is not None else b"")

        if self.hold and path.startswith(self.hold):
            self.hold = ""
            self.held = Deferred()
            return self.held.addCallback(done)
        return succeed(None).addCallback(done)

    def release(self) -> None:
        assert self.held is not None
        self.held.callback(None)


def _command(shard_id: str, gpu: int = 0) -> pb.StartShard:
    return pb.StartShard(
        shard_id=shard_id,
        model="m",
        engine="sim",
        source="sim",
        port=18123 if shard_id == "s1" else 18124,
        gpu_indices=[gpu],
        sleep_level=1,
    )


class _AdoptCase(SynchronousTestCase):
    def setUp(self) -> None:
        for module in (sleep, liveness):
            self.patch(module, "readBody", lambda answer: succeed(answer.body))
        self.reports: list[pb.ShardStatus] = []
        self.supervisor = Supervisor(
            cast(IEngineReactor, Clock()), self.reports.append, tempfile.mkdtemp()
        )

    def adopt(self, engine: _Engine, recorded_asleep: bool, turning: str = "") -> Any:
        self.supervisor.http = cast(Agent, engine)
        command = _command("s1")
        pid = os.getpid()
        start_time = process_start_time(pid)
        assert start_time is not None
        return self.supervisor.take(
            command, build(command), pid, start_time, recorded_asleep, turning
        )

    def record(self) -> dict[str, Any]:
        with open(self.supervisor.path("s1", ".json")) as f:
            return cast(dict[str, Any], json.load(f))

    def states(self) -> list[int]:
        return [r.state for r in self.reports]

    def probes_passed(self, shard: Any) -> None:
        """
        What L{Shard._probe} does once an adopted engine's probes pass
        (the fake engine does not serve the probes): the check begins.
        """
        shard._stop_probing()
        shard._ask_asleep = False
        shard.turns.begin_check()


class AdoptedCheckTests(_AdoptCase):
    def test_adopted_asleep_watched(self) -> None:
        """
        An engine adopted asleep is watched as any sleeper: its engine
        core's death (its health 503) fails it, also while the check puts
        it back to sleep (the agent's own sleep, which vLLM would never
        answer then).
        """
        engine = _Engine(sleeping=False)
        engine.hold = "/sleep"
        shard = self.adopt(engine, recorded_asleep=True)
        self.assertIsNotNone(engine.held)
        engine.health = 503
        cast(Clock, self.supervisor.reactor).advance(liveness.INTERVAL)
        self.assertEqual(shard.state, pb.SHARD_STATE_FAILED)
        self.assertEqual(engine.asked.count("/health"), 1)

    def test_wake_waits_for_the_put_back(self) -> None:
        """
        Recorded asleep, its engine awake: the server's wake, sent while
        the engine is put back to sleep, runs after it, and the shard and
        the engine end awake.
        """
        engine = _Engine(sleeping=False)
        engine.hold = "/sleep"
        shard = self.adopt(engine, recorded_asleep=True)
        self.assertIsNotNone(engine.held)
        woken = Deferred.fromCoroutine(self.supervisor.wake("s1"))
        self.assertNoResult(woken)
        engine.release()
        self.successResultOf(woken)
        self.assertEqual(
            engine.asked[:6],
            [
                "/is_sleeping",
                "/sleep?level=1",
                "/is_sleeping",
                "/metrics",
                "/wake_up",
                "/is_sleeping",
            ],
        )
        self.assertEqual(shard.state, pb.SHARD_STATE_READY)
        self.assertFalse(engine.sleeping)

    def test_discarded_weights_reloaded(self) -> None:
        """
        An engine whose gauge says it sleeps at level 2 (put to sleep so
        behind its agent's back: the shard's level is 1) is woken as vLLM's
        "Sleep Mode" document says: the weights' memory, C{reload_weights},
        the KV cache's; then asked whether it is awake.
        """
        engine = _Engine(sleeping=True)
        engine.metrics = (
            b'vllm:engine_sleep_state{engine="0",model_name="m",'
            b'sleep_state="awake"} 0.0\n'
            b'vllm:engine_sleep_state{engine="0",model_name="m",'
            b'sleep_state="discard_all"} 1.0\n'
        )
        shard = self.adopt(engine, recorded_asleep=True)
        self.successResultOf(Deferred.fromCoroutine(self.supervisor.wake("s1")))
        self.assertEqual(
            engine.asked[1:6],
            [
                "/metrics",
                "/wake_up?tags=weights",
                "/collective_rpc",
                "/wake_up?tags=kv_cache",
                "/is_sleeping",
            ],
        )
        self.assertEqual(shard.state, pb.SHARD_STATE_READY)

    def test_discard_told_by_the_level(self) -> None:
        """
        Told to sleep at level 2, an engine whose C{/metrics} says nothing
        of its sleep is woken with the reload too; the gauge saying level
        1 (C{weights_offloaded}) has it woken plainly.
        """
        for metrics, reloads in (
            (b"", True),
            (b'vllm:engine_sleep_state{sleep_state="discard_all"} 0.0\n', False),
        ):
            engine = _Engine(sleeping=False)
            engine.metrics = metrics
            shard = self.adopt(engine, recorded_asleep=False)
            self.probes_passed(shard)
            self.successResultOf(Deferred.fromCoroutine(shard.turns.sleep(2)))
            del engine.asked[:]
            self.successResultOf(Deferred.fromCoroutine(self.supervisor.wake("s1")))
            self.assertEqual("/collective_rpc" in engine.asked, reloads, engine.asked)
            self.assertEqual(shard.state, pb.SHARD_STATE_READY)
            self.supervisor.shards.clear()

    def test_gpus_held_while_checked(self) -> None:
        """
        While the check runs, the engine may be awake on its GPUs: no
        engine starts on them; once it sleeps again, one may.
        """
        engine = _Engine(sleeping=False)
        engine.hold = "/sleep"
        self.adopt(engine, recorded_asleep=True)
        with self.assertRaises(CommandRefused) as refused:
            self.supervisor.start(_command("s2"))
        self.assertEqual(refused.exception.code, "gpus_in_use")
        engine.release()
        self.patch(type(self.supervisor.shards["s1"]), "spawn", lambda shard: None)
        self.supervisor.start(_command("s2"))
        self.assertIn("s2", self.supervisor.shards)

    def test_stopped_during_the_check(self) -> None:
        """
        Taken as awake, told to stop while its engine is asked whether it
        sleeps: no C{ready} is reported.
        """
        engine = _Engine(sleeping=False)
        shard = self.adopt(engine, recorded_asleep=False)
        self.patch(shard, "_signal", lambda number: None)
        engine.hold = "/is_sleeping"
        shard.turns.begin_check()
        shard.stop(30.0)
        engine.release()
        states = [r.state for r in self.reports]
        self.assertNotIn(pb.SHARD_STATE_READY, states)
        self.assertFalse(shard.turns.checking)


class TurningTests(_AdoptCase):
    """
    An agent that ends while its engine's sleep or wake route runs leaves
    a record saying so; its successor asks the engine until it has turned
    (engines answer the state they leave until the turn is done).
    """

    def test_recorded_while_the_route_runs(self) -> None:
        """
        The record says C{turning} while the engine's sleep and wake
        routes run, and no longer once they answered.
        """
        engine = _Engine(sleeping=False)
        shard = self.adopt(engine, recorded_asleep=False)
        self.probes_passed(shard)
        self.assertEqual(shard.state, pb.SHARD_STATE_READY)
        engine.hold = "/sleep"
        slept = Deferred.fromCoroutine(self.supervisor.sleep("s1", 1))
        self.assertEqual(
            (self.record()["turning"], self.record()["sleeping"]), ("sleep", False)
        )
        engine.release()
        self.successResultOf(slept)
        self.assertEqual(
            (self.record()["turning"], self.record()["sleeping"]), ("", True)
        )
        engine.hold = "/wake_up"
        woken = Deferred.fromCoroutine(self.supervisor.wake("s1"))
        self.assertEqual(
            (self.record()["turning"], self.record()["sleeping"]), ("wake", False)
        )
        engine.release()
        self.successResultOf(woken)
        self.assertEqual(
            (self.record()["turning"], self.record()["sleeping"]), ("", False)
        )

    def turned(self, turning: str, asks: int) -> Any:
        """
        Adopt an engine recorded C{turning} whose turn ends after C{asks}
        answers of the state it leaves: the shard stays C{starting}, with
        nothing reported, until the engine has turned; then the check has
        ended and the record no longer says C{turning}.

        @return: the shard.
        """
        engine = _Engine(sleeping=turning == "wake")
        engine.turn_in = asks
        shard = self.adopt(engine, recorded_asleep=False, turning=turning)
        self.probes_passed(shard)
        for _ in range(asks):
            self.assertEqual(shard.state, pb.SHARD_STATE_STARTING)
            self.assertEqual(self.states(), [])
            cast(Clock, self.supervisor.reactor).advance(sleep.TURN_POLL)
        self.assertEqual(self.record()["turning"], "")
        self.assertFalse(shard.turns.checking)
        return shard

    def test_adopted_during_a_wake(self) -> None:
        """
        Adopted while its wake runs, the engine still answers asleep: it
        is asked again until awake, then C{ready}; never C{sleeping} (its
        GPU memory would count free while it takes it back).
        """
        self.turned("wake", 3)
        self.assertEqual(self.states(), [pb.SHARD_STATE_READY])

    def test_adopted_during_a_sleep(self) -> None:
        """
        Adopted while its sleep runs, the engine still answers awake: it
        is asked again until asleep, then C{sleeping}; never C{ready} (the
        router would send requests to an engine going to sleep).
        """
        self.turned("sleep", 2)
        self.assertEqual(self.states(), [pb.SHARD_STATE_SLEEPING])
        self.assertIs(self.record()["sleeping"], True)

    def test_answers_lost_during_a_turn(self) -> None:
        """
        Questions the engine leaves unanswered while it turns (the first
        and the third here) are asked again: adopted mid-sleep, it is
        never C{ready}, and is C{sleeping} once it says so.
        """
        engine = _Engine(sleeping=False)
        engine.turn_in = 2
        engine.lost = {1, 3}
        shard = self.adopt(engine, recorded_asleep=False, turning="sleep")
        self.probes_passed(shard)
        for _ in range(5):
            cast(Clock, self.supervisor.reactor).advance(sleep.TURN_POLL)
        self.assertEqual(self.states(), [pb.SHARD_STATE_SLEEPING])
        self.assertEqual(engine.questions, 5)

    def test_a_turn_that_never_ends(self) -> None:
        """
        An engine that never turns is asked for at most L{SLEEP_TIMEOUT};
        then what it says stands.
        """
        engine = _Engine(sleeping=True)
        shard = self.adopt(engine, recorded_asleep=False, turning="wake")
        self.probes_passed(shard)
        clock = cast(Clock, self.supervisor.reactor)
        clock.pump([sleep.TURN_POLL] * int(sleep.SLEEP_TIMEOUT / sleep.TURN_POLL - 1))
        self.assertEqual(shard.state, pb.SHARD_STATE_STARTING)
        clock.pump([sleep.TURN_POLL] * 2)
        self.assertEqual(shard.state, pb.SHARD_STATE_SLEEPING)
        asked = engine.asked.count("/is_sleeping")
        clock.pump([sleep.TURN_POLL] * 5)
        self.assertEqual(engine.asked.count("/is_sleeping"), asked)
