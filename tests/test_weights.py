"""
The agent's weights removal on real files, the answers the agent's link
gives to commands it refuses (a removal outside its weights directories, a
stop for a shard it does not run), and the order of its weights reports.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.link import AgentFactory
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.codec import FrameDecoder, encode_frame


class WeightsRemovalTests(SynchronousTestCase):
    """
    The agent's side of weights removal, on real files.
    """

    def setUp(self) -> None:
        from llmgw.agent.weights import remove

        self.remove = remove
        self.root = tempfile.mkdtemp(prefix="llmgw-weights-")
        self.dir = os.path.join(self.root, "weights")
        os.makedirs(os.path.join(self.dir, "models--org--running", "blobs"))
        for name in ("model.gguf", "old.gguf"):
            with open(os.path.join(self.dir, name), "wb") as f:
                f.write(b"w")

    def test_symlink_removed_not_its_target(self) -> None:
        """
        A link inside the weights directory to a file inside it: the link
        goes, the file it points to (a catalog model's source) stays.
        """
        link = os.path.join(self.dir, "current.gguf")
        os.symlink(os.path.join(self.dir, "model.gguf"), link)
        self.assertEqual(self.remove([self.dir], [link], []), [link])
        self.assertFalse(os.path.lexists(link))
        self.assertTrue(os.path.exists(os.path.join(self.dir, "model.gguf")))

    def test_symlink_out_removed_not_followed(self) -> None:
        """
        A link inside the weights directory pointing outside: the link
        goes, what it points to stays; a path through it is refused.
        """
        outside = os.path.join(self.root, "elsewhere")
        os.makedirs(outside)
        with open(os.path.join(outside, "keep.bin"), "wb") as f:
            f.write(b"k")
        link = os.path.join(self.dir, "escape")
        os.symlink(outside, link)
        from llmgw.agent.weights import RemovalRefused

        with self.assertRaises(RemovalRefused):
            self.remove([self.dir], [os.path.join(link, "keep.bin")], [])
        self.assertEqual(self.remove([self.dir], [link], []), [link])
        self.assertTrue(os.path.exists(os.path.join(outside, "keep.bin")))

    def test_refused(self) -> None:
        """
        Outside paths (also through '..' or a link), the directory itself,
        relative paths, and what a running engine uses, hub ids included:
        refused, and nothing of the batch deleted.
        """
        outside = os.path.join(self.root, "precious")
        with open(outside, "wb") as f:
            f.write(b"p")
        escape = os.path.join(self.dir, "escape")
        os.symlink(self.root, escape)
        old = os.path.join(self.dir, "old.gguf")
        for paths, in_use in (
            ([old, outside], []),
            ([old, os.path.join(self.dir, "..", "precious")], []),
            ([old, os.path.join(escape, "precious")], []),
            ([old, self.dir], []),
            ([old, "weights/old.gguf"], []),
            (
                [old, os.path.join(self.dir, "model.gguf")],
                [os.path.join(self.dir, "model.gguf")],
            ),
            ([old, os.path.join(self.dir, "models--org--running")], ["org/running"]),
        ):
            with self.assertRaises(Exception) as raised:
                self.remove([self.dir], paths, in_use)
            self.assertEqual(type(raised.exception).__name__, "RemovalRefused", paths)
            self.assertTrue(os.path.exists(old), paths)
        self.assertTrue(os.path.exists(outside))
        self.assertTrue(os.path.exists(os.path.join(self.dir, "models--org--running")))


class RefusalAnswerTests(SynchronousTestCase):
    """
    A command the agent refuses is answered with the refusal's own line,
    logged as a warning, not as a failure (trial fails a test that logs
    one).
    """

    def setUp(self) -> None:
        root = tempfile.mkdtemp(prefix="llmgw-refusals-")
        self.weights = os.path.join(root, "weights")
        os.makedirs(self.weights)
        self.outside = os.path.join(root, "precious")
        with open(self.outside, "wb") as f:
            f.write(b"p")
        factory = AgentFactory(
            pb.Register,
            pb.Heartbeat,
            cast(IEngineReactor, Clock()),
            os.path.join(root, "state"),
            weights_dirs=(self.weights,),
        )
        self.protocol = factory.buildProtocol(None)
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)
        self.decoder = FrameDecoder()

    def answers(self) -> list[pb.CommandResult]:
        frames = self.decoder.feed(self.transport.value())
        self.transport.clear()
        messages = [pb.AgentMessage.FromString(f) for f in frames]
        return [m.command_result for m in messages if m.HasField("command_result")]

    def test_removal_outside_refused(self) -> None:
        self.protocol.message_received(
            pb.ControlMessage(
                remove_weights=pb.RemoveWeights(command_id=3, paths=[self.outside])
            )
        )
        (answer,) = self.answers()
        self.assertEqual((answer.command_id, answer.ok), (3, False))
        self.assertTrue(
            answer.error.startswith(f"path {self.outside!r} (resolved"), answer.error
        )
        self.assertTrue(os.path.exists(self.outside))

    def test_stop_of_unknown_shard_refused(self) -> None:
        self.protocol.message_received(
            pb.ControlMessage(stop_shard=pb.StopShard(command_id=4, shard_id="s-1"))
        )
        (answer,) = self.answers()
        self.assertEqual(
            (answer.command_id, answer.ok, answer.error),
            (4, False, "no shard 's-1' on this node"),
        )


class ReportOrderTests(SynchronousTestCase):
    """
    Weights scans run in threads, so they can end out of order: the report
    the server keeps (the last one sent) must not be older than a report
    already sent.
    """

    def test_stale_scan_not_sent_after_removal(self) -> None:
        """
        A periodic scan walks a folder; meanwhile a RemoveWeights deletes it
        and starts a scan of its own, which ends first.  The slow scan's
        report, which still lists the folder, is not sent after it (the
        server would list the removed folder again for a minute).
        """
        root = tempfile.mkdtemp(prefix="llmgw-order-")
        victim = os.path.join(root, "models--org--old")
        os.makedirs(victim)
        with open(os.path.join(victim, "w.bin"), "wb") as f:
            f.write(b"x" * 10)
        pending: list[tuple[Callable[[], Any], Deferred[Any]]] = []

        def in_thread(call: Callable[[], Any]) -> Deferred[Any]:
            # A thread whose result reaches the reactor when the test says.
            d: Deferred[Any] = Deferred()
            pending.append((call, d))
            return d

        factory = AgentFactory(
            lambda: pb.Register(node_id="n1"),
            pb.Heartbeat,
            cast(IEngineReactor, Clock()),
            tempfile.mkdtemp(),
            weights_dirs=(root,),
            in_thread=in_thread,
        )
        protocol = factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        welcome = pb.ControlMessage(
            welcome=pb.Welcome(server_version="test", heartbeat_interval_seconds=5)
        )
        protocol.dataReceived(encode_frame(welcome.SerializeToString()))
        # The periodic scan started at Welcome: it walks the folder now.
        ((periodic, periodic_done),) = pending
        slow_result = periodic()
        remove = pb.ControlMessage(
            remove_weights=pb.RemoveWeights(command_id=1, paths=[victim])
        )
        protocol.dataReceived(encode_frame(remove.SerializeToString()))
        self.assertFalse(os.path.exists(victim))
        _, (after, after_done) = pending
        after_done.callback(after())
        periodic_done.callback(slow_result)
        messages = [
            pb.AgentMessage.FromString(f)
            for f in FrameDecoder().feed(transport.value())
        ]
        reports = [m.weights_report for m in messages if m.HasField("weights_report")]
        self.assertEqual(len(reports), 1)
        self.assertNotIn(victim, [f.path for f in reports[-1].files])
