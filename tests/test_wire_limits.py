"""
The frame maximum on the sending side: a message over it is an error that
names it, never written; the agent keeps to the server's maximum once
welcomed and fits its weights report in one frame; the server's link
truncation flag and the Welcome's maximum.  On a Clock, over
L{StringTransport}.
"""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.defer import maybeDeferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent import link as link_module
from llmgw.agent.link import AgentFactory
from llmgw.agent.weights import fit_report
from llmgw.control.agents import AgentHub
from llmgw.control.inventory import Inventory
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.codec import FrameDecoder, encode_frame
from llmgw.wire.protocol import CommandingStream, MessageStream, MessageTooLarge


def _files(count: int) -> list[pb.WeightsFile]:
    return [
        pb.WeightsFile(path=f"/w/{i:06d}-" + "m" * 93, size_bytes=i, last_used_unix=i)
        for i in range(count)
    ]


def _sent(transport: StringTransport, kind: type[Any]) -> list[Any]:
    messages = []
    for frame in FrameDecoder().feed(transport.value()):
        message = kind()
        message.ParseFromString(frame)
        messages.append(message)
    return messages


class SendLimitTests(SynchronousTestCase):
    def test_oversize_message_named_not_written(self) -> None:
        """
        A message over the maximum raises L{MessageTooLarge} naming its
        type, field and size; nothing is written; the link stays.
        """
        stream: MessageStream[pb.ControlMessage] = MessageStream(
            pb.ControlMessage, 1000
        )
        transport = StringTransport()
        stream.makeConnection(transport)
        report = pb.WeightsReport(files=_files(20))
        size = pb.AgentMessage(weights_report=report).ByteSize()
        with self.assertRaises(MessageTooLarge) as raised:
            stream.send(pb.AgentMessage(weights_report=report))
        self.assertEqual(
            str(raised.exception),
            f"AgentMessage.weights_report of {size} bytes is over the frame"
            " maximum of 1000 bytes: not sent",
        )
        self.assertEqual(transport.value(), b"")
        self.assertFalse(transport.disconnecting)
        stream.limit_sent(0)
        self.assertEqual(stream.max_sent, 1000)
        stream.limit_sent(5000)
        self.assertEqual(stream.max_sent, 1000)
        stream.limit_sent(500)
        self.assertEqual(stream.max_sent, 500)

    def test_oversize_command_fails_its_deferred(self) -> None:
        """
        A command over the maximum fails its Deferred with
        L{MessageTooLarge}; it is not left outstanding.
        """
        stream = CommandingStream(200)
        transport = StringTransport()
        stream.makeConnection(transport)
        waiting = stream.send_command(
            pb.ControlMessage(remove_weights=pb.RemoveWeights(paths=["/w/x" * 100]))
        )
        failure = self.failureResultOf(waiting, MessageTooLarge)
        self.assertIn("ControlMessage.remove_weights", str(failure.value))
        self.assertEqual(stream.commands.outstanding, 0)
        self.assertEqual(transport.value(), b"")

    def test_fit_report(self) -> None:
        """
        L{fit_report} keeps the first files whose message fits, with the
        total and the flag; a list that fits is whole, not flagged.
        """
        files = _files(1000)
        for limit in (1000, 20_000, 4 * 1024 * 1024):
            report = fit_report(files, limit)
            message = pb.AgentMessage(weights_report=report)
            self.assertLessEqual(message.ByteSize(), limit)
            self.assertEqual(report.total, 1000)
            self.assertEqual(report.truncated, len(report.files) < 1000)
            self.assertEqual(list(report.files), files[: len(report.files)])
            # Not much room left over: one more file would not fit.
            if report.truncated:
                self.assertGreater(
                    message.ByteSize() + files[len(report.files)].ByteSize(),
                    limit - 40,
                )
        self.assertFalse(fit_report(files, 4 * 1024 * 1024).truncated)


class AgentKeepsToServerTests(SynchronousTestCase):
    def test_welcome_lowers_the_maximum(self) -> None:
        """
        After a Welcome naming a 20,000-byte maximum, the agent's weights
        report fits in it, flagged truncated with the total; one warning,
        not one per report; a heartbeat too large is logged, not raised.
        """
        clock = Clock()
        factory = AgentFactory(
            pb.Register,
            pb.Heartbeat,
            cast(IEngineReactor, clock),
            self.mktemp(),
            weights_dirs=("/w",),
        )
        self.patch(link_module, "scan", lambda dirs: _files(1000))
        agent = factory.buildProtocol(None)
        transport = StringTransport()
        with capturedLogs() as events:
            agent.makeConnection(transport)
            agent.dataReceived(
                encode_frame(
                    pb.ControlMessage(
                        welcome=pb.Welcome(
                            heartbeat_interval_seconds=5, max_frame_size=20_000
                        )
                    ).SerializeToString()
                )
            )
            maybeDeferred(agent.send_weights)
        self.assertEqual(agent.max_sent, 20_000)
        register, first, second = _sent(transport, pb.AgentMessage)
        self.assertEqual(register.WhichOneof("kind"), "register")
        self.assertEqual(register.register.max_frame_size, 4 * 1024 * 1024)
        for message in (first, second):
            report = message.weights_report
            self.assertLessEqual(message.ByteSize(), 20_000)
            self.assertEqual((report.total, report.truncated), (1000, True))
        warnings = [e for e in events if "marked truncated" in e["log_format"]]
        self.assertEqual(len(warnings), 1)

        big = pb.Heartbeat(gpus=[pb.GpuUsage(new_problems=["x" * 30_000])])
        agent._heartbeat = lambda: big
        with capturedLogs() as events:
            clock.advance(5)
        (error,) = [e for e in events if "cannot send" in e["log_format"]]
        self.assertIn("AgentMessage.heartbeat of", error["error"])
        self.assertIsNone(error.get("log_failure"))
        agent.connectionLost()
        self.assertEqual(clock.getDelayedCalls(), [])


class ServerSideTests(SynchronousTestCase):
    def test_welcome_says_maximum_and_flag_kept(self) -> None:
        """
        The server's Welcome names its frame maximum, and it keeps to the
        agent's, said in Register, when smaller; a truncated report is
        kept with its flag and total; one longer than the inventory keeps
        is flagged too.
        """
        clock = Clock()
        inventory = Inventory()
        hub = AgentHub(clock, inventory, insecure=True, max_frame_size=2_000_000)
        link = hub.buildProtocol(None)
        transport = StringTransport()
        link.makeConnection(transport)
        with capturedLogs():
            link.dataReceived(
                encode_frame(
                    pb.AgentMessage(
                        register=pb.Register(node_id="n1", max_frame_size=100_000)
                    ).SerializeToString()
                )
            )
        (welcome,) = _sent(transport, pb.ControlMessage)
        self.assertEqual(welcome.welcome.max_frame_size, 2_000_000)
        # The server keeps to the agent's smaller maximum.
        self.assertEqual(link.max_sent, 100_000)
        waiting = hub.send(
            "n1",
            pb.ControlMessage(
                remove_weights=pb.RemoveWeights(paths=["/w/" + "x" * 200_000])
            ),
        )
        self.failureResultOf(waiting, MessageTooLarge)
        report = pb.WeightsReport(files=_files(10), total=40_000, truncated=True)
        link.dataReceived(
            encode_frame(pb.AgentMessage(weights_report=report).SerializeToString())
        )
        node = inventory.get("n1")
        assert node is not None
        self.assertEqual(
            (len(node.weights), node.weights_total, node.weights_truncated),
            (10, 40_000, True),
        )
        report = pb.WeightsReport(files=_files(10_001), total=10_001)
        link.dataReceived(
            encode_frame(pb.AgentMessage(weights_report=report).SerializeToString())
        )
        self.assertEqual(
            (len(node.weights), node.weights_total, node.weights_truncated),
            (10_000, 10_001, True),
        )
        link.connectionLost()
        self.assertEqual(clock.getDelayedCalls(), [])
