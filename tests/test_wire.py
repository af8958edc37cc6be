"""
The agent link's framing, message stream and command correlation, and the
generated protobuf code against its source.
"""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.error import ConnectionLost
from twisted.internet.testing import StringTransport
from twisted.logger import LogLevel, capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.wire import agent_pb2 as pb
from llmgw.wire.codec import FrameDecoder, FrameError, encode_frame
from llmgw.wire.protocol import CommandFailed, CommandingStream, MessageStream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CodecTests(SynchronousTestCase):
    def test_round_trip_one_byte_at_a_time(self) -> None:
        """
        Frames fed one byte at a time come out whole and in order.
        """
        payloads = [b"a", b"hello" * 100, bytes(range(256))]
        stream = b"".join(encode_frame(p) for p in payloads)
        decoder = FrameDecoder()
        out: list[bytes] = []
        for i in range(len(stream)):
            out.extend(decoder.feed(stream[i : i + 1]))
        self.assertEqual(out, payloads)
        self.assertEqual(decoder.buffered, 0)

    @settings(max_examples=200, deadline=None)
    @given(
        st.lists(st.binary(min_size=1, max_size=300), max_size=8),
        st.lists(st.integers(min_value=0, max_value=3000), max_size=20),
    )
    def test_any_split(self, payloads: list[bytes], cuts: list[int]) -> None:
        """
        However the byte stream is cut, the same payloads come out.
        """
        stream = b"".join(encode_frame(p) for p in payloads)
        points = sorted({c for c in cuts if c <= len(stream)})
        decoder = FrameDecoder()
        out: list[bytes] = []
        for a, b in zip([0, *points], [*points, len(stream)], strict=True):
            out.extend(decoder.feed(stream[a:b]))
        self.assertEqual(out, payloads)

    def test_zero_and_oversize(self) -> None:
        """
        A zero length or one over the maximum raises FrameError naming the
        size, and the decoder stays failed.
        """
        decoder = FrameDecoder(max_frame_size=10)
        with self.assertRaises(FrameError) as raised:
            decoder.feed(b"\x00\x00\x00\x00")
        self.assertEqual(raised.exception.size, 0)
        self.assertRaises(FrameError, decoder.feed, b"")
        decoder = FrameDecoder(max_frame_size=10)
        self.assertEqual(decoder.feed(encode_frame(b"x" * 10, 10)), [b"x" * 10])
        with self.assertRaises(FrameError) as raised:
            decoder.feed(b"\x00\x00\x00\x0b")
        self.assertIn("11 bytes", str(raised.exception))
        self.assertRaises(FrameError, encode_frame, b"")
        self.assertRaises(FrameError, encode_frame, b"y" * 11, 10)


class _Collector(MessageStream[pb.AgentMessage]):
    def __init__(self, max_frame_size: int = 4 * 1024 * 1024) -> None:
        super().__init__(pb.AgentMessage, max_frame_size)
        self.received: list[pb.AgentMessage] = []

    def message_received(self, message: pb.AgentMessage) -> None:
        self.received.append(message)


def _connected(protocol: MessageStream[pb.AgentMessage]) -> StringTransport:
    transport = StringTransport()
    protocol.makeConnection(transport)
    return transport


class MessageStreamTests(SynchronousTestCase):
    def test_messages_in_and_out(self) -> None:
        """
        Messages cut across reads arrive parsed; send() frames them.
        """
        stream = _Collector()
        transport = _connected(stream)
        register = pb.AgentMessage(
            register=pb.Register(
                node_id="gpu-01",
                gpus=[pb.Gpu(index=0, name="H200", memory_total_mib=143771)],
            )
        )
        data = encode_frame(register.SerializeToString()) * 2
        stream.dataReceived(data[:7])
        stream.dataReceived(data[7:])
        self.assertEqual(stream.received, [register, register])
        stream.send(pb.ControlMessage(welcome=pb.Welcome(server_version="1")))
        decoded = FrameDecoder().feed(transport.value())
        self.assertEqual(
            pb.ControlMessage.FromString(decoded[0]).welcome.server_version, "1"
        )

    def test_oversize_closes_with_log(self) -> None:
        """
        A frame over the maximum closes the connection with a log line that
        names its size; nothing after it is read.
        """
        stream = _Collector(max_frame_size=100)
        transport = _connected(stream)
        with capturedLogs() as events:
            stream.dataReceived(b"\x00\x00\x10\x00" + b"z" * 10)
        self.assertTrue(transport.disconnecting)
        (event,) = [e for e in events if e["log_level"] == LogLevel.error]
        self.assertEqual(event["size"], 4096)
        self.assertIn("4096 bytes", event["error"])
        stream.dataReceived(encode_frame(b"\x0a\x00"))
        self.assertEqual(stream.received, [])

    def test_not_a_message_closes(self) -> None:
        """
        A frame that does not parse as the expected message closes the
        connection.
        """
        stream = _Collector()
        transport = _connected(stream)
        with capturedLogs():
            stream.dataReceived(encode_frame(b"\xff\xff\xff"))
        self.assertTrue(transport.disconnecting)
        self.assertEqual(stream.received, [])


class CommandTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.stream = CommandingStream()
        self.transport = _connected(self.stream)

    def answer(self, command_id: int, ok: bool, error: str = "") -> None:
        result = pb.AgentMessage(
            command_result=pb.CommandResult(command_id=command_id, ok=ok, error=error)
        )
        self.stream.dataReceived(encode_frame(result.SerializeToString()))

    def test_results_fire_matching_command(self) -> None:
        """
        Each command gets its own id; results fire the matching Deferred,
        in whatever order they come; a failed one fails with CommandFailed.
        """
        first = self.stream.send_command(
            pb.ControlMessage(stop_shard=pb.StopShard(shard_id="s1"))
        )
        second = self.stream.send_command(
            pb.ControlMessage(start_shard=pb.StartShard(shard_id="s2"))
        )
        sent = [
            pb.ControlMessage.FromString(f)
            for f in FrameDecoder().feed(self.transport.value())
        ]
        self.assertEqual(
            [sent[0].stop_shard.command_id, sent[1].start_shard.command_id], [1, 2]
        )
        self.assertNoResult(first)
        self.answer(2, False, "port 8001 in use")
        failure = self.failureResultOf(second, CommandFailed)
        self.assertEqual(str(failure.value), "port 8001 in use")
        self.answer(1, True)
        self.assertTrue(self.successResultOf(first).ok)
        self.assertEqual(self.stream.commands.outstanding, 0)

    def test_connection_lost_fails_outstanding(self) -> None:
        """
        Commands without an answer fail when the connection is lost.
        """
        waiting = self.stream.send_command(
            pb.ControlMessage(stop_shard=pb.StopShard(shard_id="s"))
        )
        self.stream.connectionLost(Failure(ConnectionLost()))
        self.failureResultOf(waiting, ConnectionLost)

    def test_other_messages_passed_on(self) -> None:
        """
        Messages other than results go to agent_message_received; a result
        for no command is logged, not raised.
        """
        seen: list[pb.AgentMessage] = []
        self.patch(self.stream, "agent_message_received", seen.append)
        heartbeat = pb.AgentMessage(heartbeat=pb.Heartbeat())
        self.stream.dataReceived(encode_frame(heartbeat.SerializeToString()))
        with capturedLogs() as events:
            self.answer(99, True)
        self.assertEqual(seen, [heartbeat])
        self.assertEqual([e["command_id"] for e in events], [99])

    def test_welcome_is_not_a_command(self) -> None:
        """
        Only the four commands take a command_id.
        """
        self.assertRaises(
            ValueError,
            self.stream.send_command,
            pb.ControlMessage(welcome=pb.Welcome()),
        )


class GeneratedCodeTests(SynchronousTestCase):
    def test_not_stale(self) -> None:
        """
        The checked-in agent_pb2.py and .pyi are what protoc makes of
        proto/llmgw/v1/agent.proto now; run `make proto` after editing it.
        """
        out = tempfile.mkdtemp()
        subprocess.run(
            [os.path.join(ROOT, "scripts", "gen-proto"), out],
            cwd=ROOT,
            check=True,
            env={**os.environ, "PYTHON": sys.executable},
            timeout=60,
        )
        for name in ("agent_pb2.py", "agent_pb2.pyi"):
            self.assertTrue(
                filecmp.cmp(
                    os.path.join(out, name),
                    os.path.join(ROOT, "llmgw", "wire", name),
                    shallow=False,
                ),
                f"llmgw/wire/{name} is stale: run make proto",
            )


class EngineFactsTests(SynchronousTestCase):
    def test_one_list_of_engine_names(self) -> None:
        """
        The catalog accepts exactly the engines the agent can launch: the
        one list in L{llmgw.wire.engines}.
        """
        from llmgw.agent.engines import ProfileError, build
        from llmgw.config_checks import ConfigError
        from llmgw.control.catalog import parse_models
        from llmgw.wire.engines import ENGINES

        def profile(engine: str) -> list[dict[str, object]]:
            return [
                {
                    "name": "m",
                    "profiles": [{"name": "p", "engine": engine, "source": "s"}],
                }
            ]

        for engine in ENGINES:
            (model,) = parse_models(profile(engine))
            self.assertEqual(model.profiles[0].engine, engine)
            build(pb.StartShard(engine=engine, source="s", model="m", port=1))
        with self.assertRaises(ConfigError) as raised:
            parse_models(profile("tgi"))
        self.assertIn(f"(known: {', '.join(ENGINES)})", str(raised.exception))
        with self.assertRaises(ProfileError) as refused:
            build(pb.StartShard(engine="tgi", source="s", model="m", port=1))
        self.assertIn(f"(known: {', '.join(ENGINES)})", str(refused.exception))

    def test_hub_cache_name(self) -> None:
        """
        A hub id's folder in the Hugging Face cache: C{models--ORG--NAME}.
        """
        from llmgw.wire.engines import hub_cache_name

        self.assertEqual(
            hub_cache_name("google/gemma-3-270m"), "models--google--gemma-3-270m"
        )
