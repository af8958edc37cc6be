"""
The agent link's rules: unit tests of the server's end on a Clock, the
agent's state directory records, and C{twistd llmgw-agent}'s refusal of a
bad configuration.  The link end to end is in L{tests.test_e2e_agent_link}
and L{tests.test_e2e_agent_shards}.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from typing import cast

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.agents import AgentHub, AgentLink
from llmgw.control.commands import ShardCommands
from llmgw.control.inventory import Inventory
from llmgw.control.records import ShardRecord
from llmgw.control.snapshot import SuspectPorts
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb
from llmgw.wire import versions
from llmgw.wire.codec import FrameDecoder, encode_frame
from llmgw.wire.states import ShardState
from tests.support import (
    TWISTD,
    hermetic_env,
)


def _frame(message: pb.AgentMessage) -> bytes:
    return encode_frame(message.SerializeToString())


class LinkRuleTests(SynchronousTestCase):
    """
    The server's rules for a link, on a Clock, insecure (no certificate
    to compare the claim with).
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.inventory = Inventory()
        self.hub = AgentHub(self.clock, self.inventory, insecure=True)

    def connect(self) -> tuple[AgentLink, StringTransport]:
        link = self.hub.buildProtocol(None)
        transport = StringTransport()
        link.makeConnection(transport)
        return link, transport

    def test_register_deadline(self) -> None:
        """
        A connection that sends no Register within 10 s is closed.
        """
        _, transport = self.connect()
        with capturedLogs() as events:
            self.clock.advance(9.9)
            self.assertFalse(transport.disconnecting)
            self.clock.advance(0.2)
        self.assertTrue(transport.disconnecting)
        self.assertIn("no Register", events[0]["log_format"])

    def test_register_first(self) -> None:
        """
        Anything before Register closes the connection.
        """
        link, transport = self.connect()
        with capturedLogs():
            link.dataReceived(_frame(pb.AgentMessage(heartbeat=pb.Heartbeat())))
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.inventory.nodes(), [])

    def test_register_then_heartbeat(self) -> None:
        """
        Register records the node and is answered with Welcome; heartbeats
        update GPU memory; no delayed call is left.
        """
        link, transport = self.connect()
        gpu = pb.Gpu(index=0, name="H200", memory_total_mib=144384)
        with capturedLogs():
            link.dataReceived(
                _frame(pb.AgentMessage(register=pb.Register(node_id="n1", gpus=[gpu])))
            )
        (welcome,) = FrameDecoder().feed(transport.value())
        self.assertTrue(pb.ControlMessage.FromString(welcome).HasField("welcome"))
        link.dataReceived(
            _frame(
                pb.AgentMessage(
                    heartbeat=pb.Heartbeat(
                        gpus=[pb.GpuUsage(index=0, memory_used_mib=512)]
                    )
                )
            )
        )
        (node,) = self.inventory.nodes()
        self.assertEqual((node.id, node.gpus[0].memory_used_mib), ("n1", 512))
        # Only the liveness deadline is left: 30 s without a byte closes it.
        (deadline,) = self.clock.getDelayedCalls()
        self.assertEqual(deadline.getTime(), 30.0)
        self.clock.advance(29)
        link.dataReceived(_frame(pb.AgentMessage(heartbeat=pb.Heartbeat())))
        self.clock.advance(29)
        self.assertFalse(transport.disconnecting)
        with capturedLogs():
            self.clock.advance(1.1)
            self.assertTrue(transport.disconnecting)
            link.connectionLost()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def register(self, node_id: str = "n1") -> tuple[AgentLink, StringTransport]:
        link, transport = self.connect()
        gpu = pb.Gpu(index=0, name="H200", memory_total_mib=144384)
        with capturedLogs():
            link.dataReceived(
                _frame(
                    pb.AgentMessage(register=pb.Register(node_id=node_id, gpus=[gpu]))
                )
            )
        return link, transport

    def test_later_register_for_another_node(self) -> None:
        """
        A registered link that sends a Register for another node id is
        closed and the other node is not recorded.
        """
        link, transport = self.register("n1")
        with capturedLogs() as events:
            link.dataReceived(
                _frame(pb.AgentMessage(register=pb.Register(node_id="n2")))
            )
        self.assertTrue(transport.disconnecting)
        self.assertEqual([n.id for n in self.inventory.nodes()], ["n1"])
        self.assertEqual(events[0]["claim"], "n2")
        with capturedLogs():
            link.connectionLost()

    def test_problems_bounded(self) -> None:
        """
        A heartbeat with 60000 distinct problems keeps 32, quickly.
        """
        link, _ = self.register("n1")
        problems = [f"xid {i}" for i in range(60000)]
        started = time.monotonic()
        link.dataReceived(
            _frame(
                pb.AgentMessage(
                    heartbeat=pb.Heartbeat(
                        gpus=[pb.GpuUsage(index=0, new_problems=problems)]
                    )
                )
            )
        )
        self.assertLess(time.monotonic() - started, 1.0)
        self.assertEqual(len(self.inventory.nodes()[0].gpus[0].problems), 32)
        with capturedLogs():
            link.connectionLost()

    def test_command_on_lost_link_fails(self) -> None:
        """
        A command sent after the link is lost fails at once, and the hub no
        longer lists the link when the outstanding ones fail.
        """
        link, _ = self.register("n1")
        listed = []
        waiting = link.send_command(
            pb.ControlMessage(stop_shard=pb.StopShard(shard_id="s"))
        )
        waiting.addErrback(lambda f: listed.append("n1" in self.hub.links))
        with capturedLogs():
            link.connectionLost()
        self.assertEqual(listed, [False])
        late = link.send_command(
            pb.ControlMessage(stop_shard=pb.StopShard(shard_id="s"))
        )
        self.failureResultOf(late)

    def test_new_connection_replaces_old(self) -> None:
        """
        A second connection from the same agent (its C{agent_instance}:
        the agent connecting again) closes the first; the first going away
        then does not mark the node disconnected.  (Another agent's is
        refused: L{tests.test_refusals}.)
        """
        register = _frame(
            pb.AgentMessage(register=pb.Register(node_id="n1", agent_instance="a1"))
        )
        first, first_transport = self.connect()
        second, _ = self.connect()
        with capturedLogs():
            first.dataReceived(register)
            second.dataReceived(register)
            self.assertTrue(first_transport.disconnecting)
            first.connectionLost()
        self.assertIs(self.hub.links["n1"], second)
        self.assertTrue(self.inventory.nodes()[0].connected)


class SleepCommandTests(SynchronousTestCase):
    """
    The server's sleep and wake commands (L{ShardCommands.sleep},
    L{ShardCommands.wake}) over a link, the budget a Register gives, and a
    status's note.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.inventory = Inventory()
        self.hub = AgentHub(self.clock, self.inventory, insecure=True)
        self.commands = ShardCommands(
            self.clock, self.hub, SuspectPorts(), lambda: None
        )
        self.link = self.hub.buildProtocol(None)
        self.transport = StringTransport()
        self.link.makeConnection(self.transport)
        # An agent of this build: one saying no version (1.0) is never sent
        # a sleep (tests.test_version_features).
        register = pb.Register(
            node_id="n1", sleep_memory_bytes=64 << 30, protocol_version=versions.text()
        )
        with capturedLogs():
            self.link.dataReceived(_frame(pb.AgentMessage(register=register)))
        self.transport.clear()
        self.shard = ShardRecord("r-0", "n1", (0,), 8000, 0, ShardState.READY)

    def tearDown(self) -> None:
        with capturedLogs():
            self.link.connectionLost()

    def sent(self) -> pb.ControlMessage:
        (frame,) = FrameDecoder().feed(self.transport.value())
        self.transport.clear()
        return pb.ControlMessage.FromString(frame)

    def answer(self, command_id: int, **fields: object) -> None:
        result = pb.CommandResult(command_id=command_id, **fields)  # type: ignore[arg-type]
        self.link.dataReceived(_frame(pb.AgentMessage(command_result=result)))

    def test_budget_from_register(self) -> None:
        """
        C{Register.sleep_memory_bytes} is the node's C{sleep_memory_bytes},
        shown in its JSON.
        """
        (node,) = self.inventory.nodes()
        self.assertEqual(node.sleep_memory_bytes, 64 << 30)
        self.assertEqual(node.to_json()["sleep_memory_bytes"], 64 << 30)

    def test_sleep_then_wake(self) -> None:
        """
        C{SleepShard} carries the shard and level; the agent's C{ok} fires
        with its result and leaves the record sleeping; C{WakeShard}'s
        leaves it ready.
        """
        d = self.commands.sleep("n1", "r-0", 2, self.shard)
        message = self.sent()
        self.assertEqual(
            (message.sleep_shard.shard_id, message.sleep_shard.level), ("r-0", 2)
        )
        self.assertNoResult(d)
        self.answer(message.sleep_shard.command_id, ok=True)
        self.assertTrue(self.successResultOf(d).ok)
        self.assertEqual(self.shard.state, ShardState.SLEEPING)
        d = self.commands.wake("n1", "r-0", self.shard)
        message = self.sent()
        self.assertEqual(message.wake_shard.shard_id, "r-0")
        self.answer(message.wake_shard.command_id, ok=True)
        self.assertTrue(self.successResultOf(d).ok)
        self.assertEqual(self.shard.state, ShardState.READY)

    def test_refused(self) -> None:
        """
        An engine's refusal fires with the agent's result (not a failure),
        the record untouched.
        """
        d = self.commands.sleep("n1", "r-0", 1, self.shard)
        message = self.sent()
        with capturedLogs() as events:
            self.answer(
                message.sleep_shard.command_id,
                ok=False,
                code="sleep_refused",
                error="engine answered 404: Not Found",
            )
        result = self.successResultOf(d)
        self.assertEqual(
            (result.ok, result.code, result.error),
            (False, "sleep_refused", "engine answered 404: Not Found"),
        )
        self.assertEqual(self.shard.state, ShardState.READY)
        self.assertEqual(events[0]["code"], "sleep_refused")

    def test_no_link_and_unanswered(self) -> None:
        """
        A node without a link: code C{no_link}; the link lost before the
        answer: C{unanswered}; neither changes the record.
        """
        with capturedLogs():
            result = self.successResultOf(self.commands.wake("n2", "r-0", self.shard))
        self.assertEqual((result.ok, result.code), (False, "no_link"))
        d = self.commands.wake("n1", "r-0", self.shard)
        with capturedLogs():
            self.link.connectionLost()
        result = self.successResultOf(d)
        self.assertEqual((result.ok, result.code), (False, "unanswered"))
        self.assertEqual(self.shard.state, ShardState.READY)

    def test_bad_level(self) -> None:
        """
        A level other than 1 or 2 is refused before anything is sent.
        """
        with self.assertRaises(ValueError):
            self.commands.sleep("n1", "r-0", 0, self.shard)
        self.assertEqual(self.transport.value(), b"")

    def test_note_passed_on(self) -> None:
        """
        A status's note reaches the listener and is logged as a warning.
        """
        heard: list[pb.ShardStatus] = []

        class Listener:
            def node_registered(self, node_id: str, register: pb.Register) -> None:
                pass

            def shard_status(self, node_id: str, status: pb.ShardStatus) -> None:
                heard.append(status)

        self.hub.listen(Listener())
        note = "sleep refused: Sleep mode is not supported on current platform."
        status = pb.ShardStatus(
            shard_id="r-0", state=pb.SHARD_STATE_STARTING, note=note
        )
        with capturedLogs() as events:
            self.link.dataReceived(_frame(pb.AgentMessage(shard_status=status)))
        self.assertEqual([s.note for s in heard], [note])
        (warning,) = [e for e in events if e.get("note")]
        self.assertEqual(warning["log_level"].name, "warn")


class StateDirectoryTests(SynchronousTestCase):
    """
    Records in the state directory that the agent cannot use are skipped
    and kept aside (C{ID.json.unreadable}): they never stop it from
    starting, nor make it touch other files.
    """

    def test_bad_records_skipped(self) -> None:
        from twisted.internet import reactor

        from llmgw.agent.records import process_start_time
        from llmgw.agent.supervisor import Supervisor

        state = tempfile.mkdtemp()
        shards = os.path.join(state, "shards")
        os.makedirs(shards)
        victim = os.path.join(state, "victim.json")
        with open(victim, "w") as f:
            f.write("{}")
        me = os.getpid()
        alive = {"pid": me, "start_time": process_start_time(me)}
        records = {
            "bogus.json": {"command": {"bogus": 1}, **alive},
            "trav.json": {
                "command": {"shardId": "../victim", "engine": "sim"},
                **alive,
            },
            "engine.json": {
                "command": {"shardId": "engine", "engine": "nope"},
                **alive,
            },
            "garbage.json": "not json at all",
        }
        for name, data in records.items():
            with open(os.path.join(shards, name), "w") as f:
                f.write(data if isinstance(data, str) else json.dumps(data))
        os.makedirs(os.path.join(shards, "dir.json"))
        supervisor = Supervisor(
            cast(IEngineReactor, reactor), lambda status: None, state
        )
        with capturedLogs() as events:
            self.assertEqual(supervisor.adopt_running(), [])
        self.assertEqual(len(events), 5)
        self.assertTrue(os.path.exists(victim))
        # Kept aside for the operator, not dropped.
        self.assertEqual(
            sorted(os.listdir(shards)),
            sorted(name + ".unreadable" for name in [*records, "dir.json"]),
        )


class AgentConfigTests(SynchronousTestCase):
    """
    twistd llmgw-agent with a bad configuration: one line, no traceback.
    """

    timeout = 60

    def test_bad_configs(self) -> None:
        d = tempfile.mkdtemp()
        tls = os.path.join(d, "tls")
        os.makedirs(tls)
        for name in ("ca.pem", "agent.pem", "agent-key.pem"):
            with open(os.path.join(tls, name), "w") as f:
                f.write("not a certificate\n")
        state_file = os.path.join(d, "a-file")
        with open(state_file, "w") as f:
            f.write("")
        base = ["--server", "127.0.0.1:7443", "--node-id", "n1", "--insecure"]
        cases = [
            ("simulated_gpus = 5\n", base, "simulated_gpus"),
            ('[[simulated_gpus]]\nname = "H"\nmemory_gb = nan\n', base, "memory_gb"),
            ("colour = 1\n", base, "colour: unknown key"),
            (
                "",
                ["--server", "127.0.0.1:7443", "--node-id", "n1", "--tls-dir", tls],
                "cannot load the certificates",
            ),
            ("", [*base, "--state-dir", state_file], "state_dir: cannot use"),
            ("", ["--server", "nohost", "--node-id", "n1", "--insecure"], "HOST:PORT"),
            ('sleep_memory = "lots"\n', base, "sleep_memory: bad size 'lots'"),
            ('sleep_memory = "150%"\n', base, "at most 100% of the node's RAM"),
            ("sleep_memory = true\n", base, "sleep_memory: bad value true"),
            (
                'sleep_memory = "999999999GiB"\n',
                base,
                "sleep_memory: '999999999GiB' is more than this node's RAM",
            ),
        ]
        for text, args, fragment in cases:
            path = os.path.join(d, "agent.toml")
            with open(path, "w") as f:
                f.write(text)
            done = subprocess.run(
                [TWISTD, "-n", "--pidfile=", "llmgw-agent", "--config", path, *args],
                capture_output=True,
                text=True,
                timeout=30,
                env=hermetic_env(),
            )
            output = (done.stdout + done.stderr).strip()
            self.assertNotEqual(done.returncode, 0, output)
            self.assertNotIn("Traceback", output)
            self.assertEqual(len(output.splitlines()), 1, output)
            self.assertIn(fragment, output)
