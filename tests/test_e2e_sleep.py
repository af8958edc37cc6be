"""
Sleep on the node through a real link: a C{twistd llmgw-agent} process on
two simulated GPUs, its engine C{llmgw sim} in sleep mode, and the
server's L{ShardCommands} sending C{SleepShard} and C{WakeShard}; the
refused-sleep fallback; a sleeping engine adopted asleep after the agent
restarts, and asked whether it sleeps when its record is lost or stale,
or until it has turned when its agent was killed during a sleep or a wake.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Generator
from typing import Any

from twisted.internet import defer, threads

from llmgw.control.commands import ShardCommands
from llmgw.control.records import ShardRecord
from llmgw.control.snapshot import SuspectPorts
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.states import ShardState
from tests.support import free_port, http, spawn
from tests.test_e2e_agent_shards import _LinkedAgent

GIB_MIB = 1024


class SleepOnNodeTests(_LinkedAgent):
    """
    Sleep and wake through the real agent with a sim engine.
    """

    @defer.inlineCallbacks
    def respawn(
        self, name: str, meanwhile: Callable[[], object] = lambda: None
    ) -> Generator[Any, Any, None]:
        """
        Stop the agent, call C{meanwhile}, and start the agent again on two
        simulated GPUs of 80 GB.
        """
        config = os.path.join(self.dir, "agent.toml")
        with open(config, "w") as f:
            f.write('[[simulated_gpus]]\nname = "H100"\nmemory_gb = 80\n' * 2)
        old = self.hub.links.get("gpu-01")
        self.agent.stop()
        meanwhile()
        self.agent = spawn([*self.agent_argv, "--config", config], self.dir, name)
        yield self.until(lambda: self.hub.links.get("gpu-01") not in (None, old), 30)

    def used_mib(self) -> list[int]:
        (node,) = self.inventory.nodes()
        return [g.memory_used_mib for g in node.gpus]

    def begin(
        self, shard_id: str, port: int, level: int, args: list[str], gpu: int = 0
    ) -> defer.Deferred[Any]:
        model = f"m-{os.getpid()}-{port}"
        self.addCleanup(subprocess.run, ["pkill", "-f", "--", f"--model {model}"])
        command = pb.StartShard(
            shard_id=shard_id,
            model=model,
            engine="sim",
            port=port,
            gpu_indices=[gpu],
            args=args,
            api_key="engine-key",
            sleep_level=level,
            gpu_memory_gb=20,
            sleep_gpu_memory_gb=1.5,
        )
        d: defer.Deferred[Any] = self.hub.links["gpu-01"].send_command(
            pb.ControlMessage(start_shard=command)
        )
        return d

    @defer.inlineCallbacks
    def ready_sleeper(
        self, shard_id: str, seconds: float = 0.3
    ) -> Generator[Any, Any, Any]:
        """
        On an agent with two simulated GPUs, a sim engine in sleep mode
        (level 1, C{seconds} to sleep or wake), ready.

        @return: the server's L{ShardCommands} and the engine's port.
        """
        from twisted.internet import reactor

        yield self.respawn("agent-gpus")
        commands = ShardCommands(reactor, self.hub, SuspectPorts(), lambda: None)
        port = free_port()
        args = ["--sleep-seconds", f"{seconds}", "--wake-seconds", f"{seconds}"]
        yield self.begin(shard_id, port, 1, args)
        yield self.until(lambda: "SHARD_STATE_READY" in self.states(shard_id), 30)
        return commands, port

    def notes(self, shard_id: str) -> list[str]:
        return [
            s.note for _, s in self.heard.statuses if s.shard_id == shard_id and s.note
        ]

    @defer.inlineCallbacks
    def test_sleep_then_wake(self) -> Generator[Any, Any, None]:
        """
        A sim engine started with sleep level 1 holds its 20 GB on its
        simulated GPU; asleep it holds 1.5 GB (the heartbeats say so), and
        the engine itself says it sleeps; an agent restarted meanwhile
        lists it sleeping and can wake it, back to 20 GB, ready.  One whose
        memory after the wake is not the expected one carries a note.
        """
        commands, port = yield self.ready_sleeper("s1")
        yield self.until(lambda: self.used_mib() == [20 * GIB_MIB, 0], 15)
        record = ShardRecord("s1", "gpu-01", (0,), port, 0, ShardState.READY)
        result = yield commands.sleep("gpu-01", "s1", 1, record)
        self.assertEqual((result.ok, result.error), (True, ""))
        self.assertEqual(record.state, ShardState.SLEEPING)
        self.assertEqual(self.states("s1")[-1], "SHARD_STATE_SLEEPING")
        yield self.until(lambda: self.used_mib() == [int(1.5 * GIB_MIB), 0], 15)
        _, _, body = yield threads.deferToThread(
            http, "GET", f"http://127.0.0.1:{port}/is_sleeping"
        )
        self.assertEqual(json.loads(body), {"is_sleeping": True})

        self.heard.statuses.clear()
        yield self.respawn("agent-again")
        (node,) = self.inventory.nodes()
        self.assertEqual([s["state"] for s in node.shards], ["sleeping"])
        result = yield commands.wake("gpu-01", "s1", record)
        self.assertEqual((result.ok, result.error), (True, ""))
        self.assertEqual(self.states("s1"), ["SHARD_STATE_WAKING", "SHARD_STATE_READY"])
        self.assertEqual(record.state, ShardState.READY)
        self.assertEqual(self.notes("s1"), [])
        yield self.until(lambda: self.used_mib() == [20 * GIB_MIB, 0], 15)
        status, _, _ = yield threads.deferToThread(
            http,
            "POST",
            f"http://127.0.0.1:{port}/v1/completions",
            json.dumps({"model": node.shards[0]["model"], "prompt": "p"}).encode(),
            {"Authorization": "Bearer engine-key", "Content-Type": "application/json"},
        )
        self.assertEqual(status, 200)

        # A second engine holding 23 GB where 20 are expected.
        other = free_port()
        yield self.begin("s2", other, 2, ["--gpu-memory-gb", "23"], gpu=1)
        yield self.until(lambda: "SHARD_STATE_READY" in self.states("s2"), 30)
        yield commands.sleep("gpu-01", "s2", 2)
        result = yield commands.wake("gpu-01", "s2")
        self.assertTrue(result.ok)
        self.assertEqual(
            self.notes("s2"), ["gpu memory after wake: 23 GB held, expected 20 GB"]
        )

    @defer.inlineCallbacks
    def test_refused_sleep_mode(self) -> Generator[Any, Any, None]:
        """
        An engine that refuses sleep mode at start as vLLM does on a CPU
        is started again without it, the server told the engine's line;
        a sleep is then refused with code C{sleep_refused}, the shard
        still ready.
        """
        from twisted.internet import reactor

        commands = ShardCommands(reactor, self.hub, SuspectPorts(), lambda: None)
        port = free_port()
        yield self.begin("s3", port, 1, ["--sleep-mode-unsupported"])
        yield self.until(lambda: "SHARD_STATE_READY" in self.states("s3"), 30)
        self.assertEqual(
            self.notes("s3"),
            [
                "sleep refused: ValueError: Sleep mode is not supported on current"
                " platform."
            ],
        )
        self.assertNotIn("SHARD_STATE_FAILED", self.states("s3"))
        result = yield commands.sleep("gpu-01", "s3", 1)
        self.assertEqual((result.ok, result.code), (False, "sleep_refused"))
        self.assertIn("without sleep mode", result.error)
        self.assertEqual(self.states("s3")[-1], "SHARD_STATE_READY")

    @defer.inlineCallbacks
    def test_adopted_as_the_engine_says(self) -> Generator[Any, Any, None]:
        """
        A restarted agent asks an engine in sleep mode whether it sleeps:
        one asleep whose record was lost (its marker says awake) is listed
        sleeping, not ready; one recorded asleep but awake (woken behind
        the agent's back) is put back to sleep, as the server counts its
        GPU memory free.
        """
        commands, port = yield self.ready_sleeper("s4")
        result = yield commands.sleep("gpu-01", "s4", 1)
        self.assertEqual((result.ok, result.error), (True, ""))
        record = os.path.join(self.dir, "state", "shards", "s4.json")

        self.heard.statuses.clear()
        yield self.respawn("agent-no-record", lambda: os.remove(record))
        yield self.until(lambda: "SHARD_STATE_SLEEPING" in self.states("s4"), 30)
        self.assertNotIn("SHARD_STATE_READY", self.states("s4"))
        self.assertIn("adopted as awake, its engine sleeps", self.agent.output())
        yield self.until(lambda: self.asleep(port) is True, 5)
        with open(record) as f:
            self.assertIs(json.load(f)["sleeping"], True)

        def wake_behind_its_back() -> None:
            status, _, _ = http(
                "POST",
                f"http://127.0.0.1:{port}/wake_up",
                b"",
                {"Authorization": "Bearer engine-key"},
            )
            self.assertEqual(status, 200)

        self.heard.statuses.clear()
        yield self.respawn("agent-stale", wake_behind_its_back)
        yield self.until(
            lambda: "recorded asleep, its engine is awake" in self.agent.output(), 30
        )
        yield self.until(lambda: self.asleep(port) is True, 10)
        (node,) = self.inventory.nodes()
        self.assertEqual([s["state"] for s in node.shards], ["sleeping"])
        self.assertNotIn("SHARD_STATE_READY", self.states("s4"))
        result = yield commands.wake("gpu-01", "s4")
        self.assertEqual((result.ok, result.error), (True, ""))

    @defer.inlineCallbacks
    def test_agent_killed_while_it_turns(self) -> Generator[Any, Any, None]:
        """
        An agent killed while its engine wakes (then while it sleeps)
        leaves a record saying so; its successor asks the engine until it
        has turned, and lists it as it ends: ready once awake, never
        sleeping while it takes its GPU memory back (and the other way).
        """
        commands, port = yield self.ready_sleeper("s5", seconds=3.0)
        result = yield commands.sleep("gpu-01", "s5", 1)
        self.assertEqual((result.ok, result.error), (True, ""))
        commands.wake("gpu-01", "s5")
        yield self.killed_while("s5", "wake", "SHARD_STATE_READY")
        self.assertIs(self.asleep(port), False)
        commands.sleep("gpu-01", "s5", 1)
        yield self.killed_while("s5", "sleep", "SHARD_STATE_SLEEPING")
        self.assertIs(self.asleep(port), True)

    @defer.inlineCallbacks
    def killed_while(
        self, shard_id: str, route: str, ends: str
    ) -> Generator[Any, Any, None]:
        """
        Once C{shard_id}'s record says its engine's C{route} runs, kill the
        agent and start it again: the shard's first state but C{starting}
        from the new agent is C{ends}, and its record no longer says
        C{turning}.
        """
        record = os.path.join(self.dir, "state", "shards", f"{shard_id}.json")

        def turning() -> object:
            with open(record) as f:
                return json.load(f).get("turning")

        yield self.until(lambda: turning() == route, 10)
        self.agent.popen.kill()
        self.agent.popen.wait()
        self.heard.statuses.clear()
        yield self.respawn(f"agent-killed-{route}")
        yield self.until(lambda: ends in self.states(shard_id), 30)
        self.assertEqual(self.states(shard_id)[-1], ends)
        self.assertEqual(set(self.states(shard_id)) - {"SHARD_STATE_STARTING"}, {ends})
        self.assertEqual(turning(), "")

    def asleep(self, port: int) -> object:
        """
        @return: what the engine on C{port} says of C{is_sleeping}.
        """
        _, _, body = http("GET", f"http://127.0.0.1:{port}/is_sleeping")
        return json.loads(body).get("is_sleeping")
