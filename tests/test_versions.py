"""
Versions that mix (L{llmgw.wire.versions}): the rule, and C{twistd
llmgw-server} serving the agent link of this build (L{llmgw.agent.link},
run here in the test's reactor so that each Register can be of another
version) and routers' requests of the admin API, over loopback.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any, cast

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionDone
from twisted.internet.task import deferLater
from twisted.logger import ILogObserver, capturedLogs, formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.agent.link import AgentFactory
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.versions import PROTOCOL, mismatch, text
from tests.support import Processes, free_port, http

MINOR = PROTOCOL[1]


class RuleTests(SynchronousTestCase):
    def test_one_minor_apart(self) -> None:
        """
        The same major and at most one minor apart is served; two minors,
        another major or no version at all otherwise; none said is 1.0.
        """
        ours = (1, 1)
        for said in ("1.0", "1.1", "1.2", ""):
            self.assertEqual(mismatch(said, "agent", ours), "", said)
        for said in ("1.3", "2.1", "0.1", "1", "x.y", "1.1.1"):
            self.assertTrue(mismatch(said, "agent", ours), said)
        self.assertEqual(
            mismatch("1.3", "agent", ours),
            "the agent speaks protocol 1.3, newer than this server's 1.1 by more"
            " than one minor version: upgrade one minor version at a time,"
            " standby servers first, then the leader, routers, agents",
        )
        self.assertEqual(
            mismatch("", "agent", (1, 2)), mismatch("1.0", "agent", (1, 2))
        )
        self.assertIn("older", mismatch("", "agent", (1, 2)))


class AgentSideTests(SynchronousTestCase):
    def test_server_far_apart_warned(self) -> None:
        """
        A Welcome from a server two minor versions apart (one of an older
        build serves any Register) is warned of, once, naming both
        versions; one a minor apart, or saying none (1.0), is not.
        """
        from twisted.internet.task import Clock
        from twisted.internet.testing import StringTransport

        from llmgw.wire.codec import encode_frame

        warned = []
        for said in (f"1.{MINOR + 2}", f"1.{MINOR + 1}", "", text()):
            factory = AgentFactory(
                lambda: pb.Register(node_id="n1"),
                pb.Heartbeat,
                cast(IEngineReactor, Clock()),
                self.mktemp(),
            )
            agent = factory.buildProtocol(None)
            agent.makeConnection(StringTransport())
            welcome = pb.Welcome(server_version="9.9", protocol_version=said)
            with capturedLogs() as events:
                agent.dataReceived(
                    encode_frame(pb.ControlMessage(welcome=welcome).SerializeToString())
                )
            warned.append(
                [formatEvent(e) for e in events if e["log_level"].name == "warn"]
            )
            agent.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(
            warned,
            [
                [
                    f"llmgw-server 9.9 speaks protocol 1.{MINOR + 2}, this agent"
                    f" {text()}: more than one minor version apart; upgrade one"
                    " minor version at a time, standby servers first, then the"
                    " leader, routers, agents"
                ],
                [],
                [],
                [],
            ],
        )


def _with_unknown_field(register: pb.Register) -> pb.Register:
    """
    @return: C{register} with field 1000 (a string this build has no name
        for, as a newer agent's would be) kept as an unknown field.
    """
    tag = (1000 << 3) | 2
    varint = bytes([(tag & 0x7F) | 0x80, tag >> 7])
    extra = varint + bytes([5]) + b"newer"
    return pb.Register.FromString(register.SerializeToString() + extra)


class AgentVersionTests(Processes, TestCase):
    """
    C{twistd llmgw-server} with plaintext agent links; each test's agent
    link registers as another version would.
    """

    timeout = 60

    def setUp(self) -> None:
        self.agent_port = free_port()
        self.server, _, self.admin_url = self.start_server(
            "--agent-listen",
            f"tcp:{self.agent_port}:interface=127.0.0.1",
            config="insecure_agents = true\n",
        )

    @defer.inlineCallbacks
    def link(self, register: pb.Register) -> Generator[Any, Any, list[dict[str, Any]]]:
        """
        Connect an agent link that sends C{register}; wait for its Welcome
        or for the server to close it.

        @return: the agent's log events.
        """
        from twisted.internet import reactor

        events: list[dict[str, Any]] = []
        observer = cast(ILogObserver, events.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        factory = AgentFactory(
            lambda: register,
            pb.Heartbeat,
            cast(IEngineReactor, reactor),
            self.mktemp(),
        )
        factory.dialing = f"127.0.0.1:{self.agent_port}"
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.agent_port)
        agent = yield endpoint.connect(factory)
        try:
            yield agent.registered
            agent.transport.loseConnection()
        except Exception:
            pass
        yield deferLater(reactor, 0.1, lambda: None)
        return events

    def nodes(self) -> dict[str, Any]:
        status, _, body = http("GET", self.admin_url + "/api/v1/nodes")
        self.assertEqual(status, 200, body)
        return {n["id"]: n for n in json.loads(body)["nodes"]}

    @defer.inlineCallbacks
    def test_versions(self) -> Generator[Deferred[Any], Any, None]:
        """
        Served: an agent sending a field the server does not know; one of
        the previous minor version lacking the fields added since (no
        protocol version, no sleep memory); one a minor newer.  Refused:
        one two minor versions newer, whose log says why, and which the
        server does not list.
        """
        newer = pb.Register(
            node_id="newer", protocol_version=text(), sleep_memory_bytes=1 << 30
        )
        yield self.link(_with_unknown_field(newer))
        previous = pb.Register(node_id="previous")
        yield self.link(previous)
        ahead = pb.Register(node_id="ahead", protocol_version=f"1.{MINOR + 1}")
        yield self.link(ahead)
        far = pb.Register(node_id="far", protocol_version=f"1.{MINOR + 2}")
        events = yield self.link(far)
        nodes = self.nodes()
        self.assertEqual(sorted(nodes), ["ahead", "newer", "previous"])
        self.server.wait_for(r"agent previous registered .* protocol 1\.0")
        (told,) = [
            e
            for e in events
            if e.get("code") == "protocol_version"
            and "refused this agent" in e.get("log_format", "")
        ]
        self.assertEqual(
            formatEvent(told),
            f"the server at 127.0.0.1:{self.agent_port} refused this agent:"
            f" {mismatch(far.protocol_version, 'agent')} (certificate none, node id"
            f" 'far'); this agent speaks protocol {text()}; upgrade it or the"
            " server; retrying",
        )
        self.assertIn("newer than this server's", formatEvent(told))

    def test_router_versions(self) -> None:
        """
        The routes a router uses answer a router one minor version apart
        (or one saying none, 1.0) and refuse one two apart with 409 and
        the reason; every answer says the server's version.
        """
        url = self.admin_url + "/api/v1/touch"
        body = b'{"names": []}'
        for said, status in (
            (None, 200),
            (f"1.{MINOR - 1}", 200),
            (text(), 200),
            (f"1.{MINOR + 1}", 200),
            (f"1.{MINOR + 2}", 409),
            ("2.0", 409),
        ):
            headers = {"content-type": "application/json"}
            if said is not None:
                headers["LLMGW-Protocol"] = said
            got, answer_headers, answer = http("POST", url, body, headers)
            self.assertEqual(got, status, (said, answer))
            self.assertEqual(answer_headers.get("llmgw-protocol"), text())
            if status == 409:
                error = json.loads(answer)["error"]
                self.assertEqual(error["code"], "protocol_version")
                self.assertIn(f"the router speaks protocol {said}", error["message"])


class RouterSideTests(SynchronousTestCase):
    def test_router_says_its_version_and_logs_refusal(self) -> None:
        """
        The router's admin client says its version on every request, and
        its follower logs a 409 refusal with the server's reason (the
        answer the admin API gives, L{AgentVersionTests.test_router_versions}).
        """
        from twisted.internet.task import Clock

        from llmgw.tier.admin_client import AdminClient
        from llmgw.tier.follow import Follower
        from tests.test_tier import _Agent, _Response

        clock, agent = Clock(), _Agent()
        asked_headers = []
        request = agent.request

        def recording(method: bytes, url: bytes, *args: Any) -> Deferred[Any]:
            asked_headers.append(args[0])
            return request(method, url, *args)

        agent.request = recording  # type: ignore[method-assign]
        control = AdminClient(["http://10.0.0.1:9090"], agent=agent)
        follower = Follower(clock, control, lambda e, n, k: None)
        reason = mismatch("1.1", "router", (1, 3))
        refusal = {"error": {"message": reason, "code": "protocol_version"}}
        with capturedLogs() as events:
            follower.startService()
            self.addCleanup(follower.stopService)
            agent.asked[-1][1].callback(_Response(409, json.dumps(refusal).encode()))
        self.assertEqual(
            asked_headers[0].getRawHeaders(b"llmgw-protocol"), [text().encode()]
        )
        self.assertEqual(
            [formatEvent(e) for e in events if e["log_level"].name == "warn"],
            [
                "the control plane at http://10.0.0.1:9090 refused the watch: HTTP"
                f" 409: {reason}"
            ],
        )
