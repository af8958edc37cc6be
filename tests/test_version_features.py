"""
Features withheld from peers too old for them (issue 37 item 7,
L{llmgw.wire.versions.FEATURES}): a router of the previous protocol version
is handed no LoRA adapter by the watch, an agent of it is never sent
C{SleepShard} or C{WakeShard}.  Each feature's test runs a peer of the
version before it: an agent link that registers through the real wire code
as an agent of 1.0 does (no C{protocol_version}), and a router's watch of
C{twistd llmgw-server} opened as a router of 1.0 opens it (no
C{LLMGW-Protocol} header); the control plane's side is in
L{tests.test_plane_sleep.OldAgentTests}.
"""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from llmgw.control.agents import AgentHub, TooOld
from llmgw.control.inventory import Inventory
from llmgw.router.interfaces import Endpoint
from llmgw.tier.watch import Watch, endpoint_json
from llmgw.wire import agent_pb2 as pb
from llmgw.wire import versions
from llmgw.wire.codec import FrameDecoder, encode_frame
from tests.support import Processes
from tests.typing_support import as_request


def before(feature: versions.Feature) -> tuple[int, int]:
    """
    @return: the version before C{feature}'s, a peer that lacks it.
    """
    return feature.since[0], feature.since[1] - 1


BASE = Endpoint(
    "r1",
    "http://10.0.0.1:8000",
    ("chat", "chat-alias", "ad-a", "ad-a-alias"),
    api_key="s3cret",
    adapters=(("ad-a", "/adapters/a"),),
    max_loras=2,
)
NAMES = {"chat": "chat", "chat-alias": "chat", "ad-a": "ad-a", "ad-a-alias": "ad-a"}


class RuleTests(SynchronousTestCase):
    def test_features_and_their_versions(self) -> None:
        """
        Every feature came with a version this build speaks, after the
        oldest it serves; a peer has a feature from its version on, and
        the reason it lacks one names both versions.
        """
        self.assertEqual([f.name for f in versions.FEATURES], ["adapters", "sleep"])
        for feature in versions.FEATURES:
            self.assertLessEqual(feature.since, versions.PROTOCOL)
            self.assertFalse(versions.supports(versions.UNSAID, feature))
            self.assertTrue(versions.supports(versions.PROTOCOL, feature))
            self.assertEqual(versions.lacks(versions.PROTOCOL, feature, "agent"), "")
            self.assertIn(feature.peer, ("router", "agent"))
        self.assertEqual(
            versions.lacks((1, 0), versions.SLEEP, "agent"),
            "the agent speaks protocol 1.0; sleep needs 1.1 (upgrade it)",
        )
        self.assertEqual(versions.peer_version(""), versions.UNSAID)
        self.assertEqual(versions.peer_version("x"), versions.UNSAID)
        self.assertEqual(versions.peer_version("1.4"), (1, 4))


class WatchTests(SynchronousTestCase):
    def watched(self, protocol: tuple[int, int]) -> dict[str, Any]:
        """
        @return: the first state a watcher of C{protocol} gets, the
            catalog holding adapter C{ad-a} of C{chat}.
        """
        watch = Watch(Clock(), lambda: NAMES, lambda: ["ad-a"])
        watch.startService()
        self.addCleanup(watch.stopService)
        watch.set_endpoints([BASE])
        request = DummyRequest([b""])
        watch.watch(as_request(request), protocol)
        state: dict[str, Any] = json.loads(b"".join(request.written))
        return state

    def test_old_router_gets_no_adapter(self) -> None:
        """
        A router older than adapters gets the base's names and endpoint
        with no adapter in them (no name, no model, no C{adapters}, no
        C{max_loras}); a router of this version gets them all.
        """
        old = self.watched(before(versions.ADAPTERS))
        self.assertEqual(old["names"], {"chat": "chat", "chat-alias": "chat"})
        (endpoint,) = old["endpoints"]
        self.assertEqual(endpoint["models"], ["chat", "chat-alias"])
        self.assertEqual((endpoint["adapters"], endpoint["max_loras"]), ([], 0))
        self.assertEqual(endpoint["api_key"], "s3cret")
        current = self.watched(versions.PROTOCOL)
        self.assertEqual(current["names"], NAMES)
        self.assertEqual(current["endpoints"], [endpoint_json(BASE)])

    def test_changes_pushed_per_version(self) -> None:
        """
        A change reaches watchers of both versions, each in its own
        spelling.
        """
        names = dict(NAMES)
        watch = Watch(Clock(), lambda: names, lambda: ["ad-a"])
        watch.startService()
        self.addCleanup(watch.stopService)
        old, new = DummyRequest([b""]), DummyRequest([b""])
        watch.watch(as_request(old), before(versions.ADAPTERS))
        watch.watch(as_request(new), versions.PROTOCOL)
        names["ad-b"] = "ad-b"
        watch.changed()
        last = [json.loads(r.written[-1]) for r in (old, new)]
        self.assertNotIn("ad-a", last[0]["names"])
        self.assertEqual(last[1]["names"]["ad-b"], "ad-b")


def _sent(transport: StringTransport) -> list[pb.ControlMessage]:
    return [
        pb.ControlMessage.FromString(frame)
        for frame in FrameDecoder().feed(transport.value())
    ]


class AgentCommandTests(SynchronousTestCase):
    def link(self, register: pb.Register) -> tuple[AgentHub, StringTransport]:
        """
        A plaintext agent link of the server that received C{register},
        framed as an agent sends it.
        """
        hub = AgentHub(Clock(), Inventory(), insecure=True)
        link = hub.buildProtocol(None)
        transport = StringTransport()
        link.makeConnection(transport)
        message = pb.AgentMessage(register=register)
        link.dataReceived(encode_frame(message.SerializeToString()))
        self.assertTrue(_sent(transport)[0].HasField("welcome"))
        self.addCleanup(link.connectionLost)
        return hub, transport

    def test_old_agent_never_sent_sleep(self) -> None:
        """
        An agent that registered saying no protocol version (1.0, before
        sleep) is never sent C{SleepShard} or C{WakeShard}: the send fails
        at once with L{TooOld}, naming the node and both versions, and
        nothing reaches the link; a C{StopShard} still goes.  An agent of
        this version is sent C{SleepShard}.
        """
        old = pb.Register(node_id="n1", sleep_memory_bytes=1 << 36)
        hub, transport = self.link(old)
        for command in (
            pb.ControlMessage(sleep_shard=pb.SleepShard(shard_id="s", level=1)),
            pb.ControlMessage(wake_shard=pb.WakeShard(shard_id="s")),
        ):
            failure = self.failureResultOf(hub.send("n1", command), TooOld)
            self.assertEqual(
                str(failure.value),
                "node n1: the agent speaks protocol 1.0; sleep needs 1.1 (upgrade it)",
            )
        self.assertEqual(len(_sent(transport)), 1)
        stop = pb.ControlMessage(stop_shard=pb.StopShard(shard_id="s"))
        hub.send("n1", stop).addErrback(lambda _: None)
        self.assertTrue(_sent(transport)[-1].HasField("stop_shard"))

        current = pb.Register(node_id="n2", protocol_version=versions.text())
        hub, transport = self.link(current)
        sleep = pb.ControlMessage(sleep_shard=pb.SleepShard(shard_id="s", level=1))
        hub.send("n2", sleep).addErrback(lambda _: None)
        self.assertTrue(_sent(transport)[-1].HasField("sleep_shard"))


def first_watch_line(admin_url: str, said: str | None) -> dict[str, Any]:
    """
    Open C{GET /api/v1/watch} as a router saying C{said} in
    C{LLMGW-Protocol} (none: a router of 1.0) and read its first state.
    """
    parts = urlsplit(admin_url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, 10)
    try:
        headers = {} if said is None else {versions.HEADER: said}
        connection.request("GET", "/api/v1/watch", headers=headers)
        response = connection.getresponse()
        assert response.status == 200, response.status
        line: dict[str, Any] = json.loads(response.readline())
        return line
    finally:
        connection.close()


CATALOG = """
[[models]]
name = "chat"
min_replicas = 0
max_loras = 2
[[models.profiles]]
name = "sim"
engine = "sim"
source = "sim"

[[models]]
name = "ad-a"
aliases = ["ad-a-alias"]
base = "chat"
adapter = "/adapters/a"
"""


class ServerWatchTests(Processes, SynchronousTestCase):
    timeout = 60

    def test_router_of_previous_version(self) -> None:
        """
        C{twistd llmgw-server} with adapter C{ad-a} of C{chat}: its watch,
        opened as a router of 1.0 opens it (no C{LLMGW-Protocol}), names
        the base but no adapter; opened as a router of this version, both.
        The server logs what it withheld.
        """
        server, _, admin_url = self.start_server(
            "--agent-listen",
            "tcp:0:interface=127.0.0.1",
            config="insecure_agents = true\n" + CATALOG,
        )
        old = first_watch_line(admin_url, None)
        self.assertEqual(old["names"], {"chat": "chat"})
        current = first_watch_line(admin_url, versions.text())
        self.assertEqual(
            current["names"],
            {"chat": "chat", "ad-a": "ad-a", "ad-a-alias": "ad-a"},
        )
        server.wait_for(
            r"a router watches \(version \d+, protocol 1\.0;"
            r" withheld: adapters\)"
        )
