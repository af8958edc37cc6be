"""
Refusals on the wire, on a Clock: each link the server refuses is told why
in a C{Refused} before it closes; a second agent for a node whose link is
alive is refused, and takes over only once that link is silent for
C{unreachable_after}; the agent warns of a refusal once per kind and backs
off; one agent per state directory (L{hold_state_dir}).  The same through
real processes:
L{tests.test_e2e_refusals}.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from typing import Any, cast

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from OpenSSL import SSL
from service_identity import VerificationError
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.link import AgentFactory, handshake_failure
from llmgw.agent.service import AgentService
from llmgw.agent.state_lock import LOCK_FILE, hold_state_dir
from llmgw.config_checks import ConfigError
from llmgw.control.agents import AgentHub, AgentLink
from llmgw.control.inventory import Inventory
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.codec import FrameDecoder, encode_frame
from llmgw.wire.refusals import Refusal
from tests.test_agent_service import _Endpoint


def _frame(**kind: Any) -> bytes:
    return encode_frame(pb.AgentMessage(**kind).SerializeToString())


def _register(node_id: str = "n1", instance: str = "") -> bytes:
    return _frame(register=pb.Register(node_id=node_id, agent_instance=instance))


class _Peer:
    """
    A peer certificate as pyOpenSSL gives it: C{to_cryptography()}.
    """

    def __init__(self, common_name: str) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        self._certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(1)
            .not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256())
        )

    def to_cryptography(self) -> x509.Certificate:
        return self._certificate


class _TLSTransport(StringTransport):
    """
    A transport whose peer presented a certificate of C{common_name}.
    """

    def __init__(self, common_name: str | None, port: int) -> None:
        super().__init__(peerAddress=IPv4Address("TCP", "10.0.0.9", port))
        self._peer_certificate = _Peer(common_name) if common_name else None

    def getPeerCertificate(self) -> _Peer | None:
        return self._peer_certificate


def _sent(transport: StringTransport) -> list[pb.ControlMessage]:
    return [
        pb.ControlMessage.FromString(frame)
        for frame in FrameDecoder().feed(transport.value())
    ]


class ServerRefusalTests(SynchronousTestCase):
    """
    The server's end: every refusal is a C{Refused} naming the reason (the
    log line's sentence), the certificate's CN and the claim, then a close.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(100)
        self.inventory = Inventory()
        self.hub = AgentHub(
            self.clock, self.inventory, unreachable_after=15, heartbeat_interval=5
        )
        self.ports = iter(range(40000, 41000))

    def connect(self, cn: str | None = "n1") -> tuple[AgentLink, _TLSTransport]:
        link = self.hub.buildProtocol(None)
        transport = _TLSTransport(cn, next(self.ports))
        link.makeConnection(transport)
        return link, transport

    def assert_refused(
        self,
        transport: _TLSTransport,
        events: list[Any],
        code: Refusal,
        cn: str,
        claim: str,
        logged: bool = True,
    ) -> pb.Refused:
        """
        The last message sent is a C{Refused} of C{code}, its reason the
        sentence of the server's one warning or error (none when not
        C{logged}: the same refusal was logged within the minute), and the
        link is closing.
        """
        self.assertTrue(transport.disconnecting)
        refused = _sent(transport)[-1].refused
        self.assertEqual(
            (refused.code, refused.certificate_name, refused.node_id),
            (code.value, cn, claim),
        )
        lines = [formatEvent(e) for e in events if e["log_level"].name != "info"]
        if not logged:
            self.assertEqual(lines, [])
            return refused
        (line,) = lines
        if code is Refusal.BAD_FRAME:
            # MessageStream's own line, which names the peer's address.
            self.assertRegex(line, r"^closing the connection from IPv4Address")
            self.assertTrue(line.endswith(": " + refused.reason), line)
        else:
            port = transport.getPeer().port
            self.assertEqual(
                line,
                f"refusing agent connection from 10.0.0.9:{port}: " + refused.reason,
            )
        return refused

    def test_each_refusal_told(self) -> None:
        """
        No Register within 10 s, something else first, a Register without
        a node id, a claim that is not the certificate's CN, a later
        Register for another node, and a frame of zero bytes: each is told
        its code and reason before the close, and no node is recorded but
        the one that registered.
        """
        cases: list[tuple[Refusal, str, str, str, bytes | None]] = [
            (Refusal.REGISTER_TIMEOUT, "no Register within 10.0s", "n1", "", None),
            (
                Refusal.REGISTER_FIRST,
                "first message was heartbeat, not Register",
                "n1",
                "",
                _frame(heartbeat=pb.Heartbeat()),
            ),
            (Refusal.NO_NODE_ID, "Register without a node id", "n1", "", _register("")),
            (
                Refusal.CERTIFICATE_MISMATCH,
                "certificate CN 'gpu-01' claims to be node 'gpu-03'",
                "gpu-01",
                "gpu-03",
                _register("gpu-03"),
            ),
            (
                Refusal.BAD_FRAME,
                "frame of 0 bytes: empty",
                "n1",
                "",
                b"\x00\x00\x00\x00",
            ),
        ]
        for code, reason, cn, claim, data in cases:
            link, transport = self.connect(cn)
            with capturedLogs() as events:
                if data is None:
                    self.clock.advance(10)
                else:
                    link.dataReceived(data)
            refused = self.assert_refused(transport, list(events), code, cn, claim)
            self.assertEqual(refused.reason, reason)
            link.connectionLost()
        self.assertEqual(self.inventory.nodes(), [])
        link, transport = self.connect("n1")
        with capturedLogs():
            link.dataReceived(_register("n1"))
        with capturedLogs() as events:
            link.dataReceived(_register("n2"))
        refused = self.assert_refused(
            transport, list(events), Refusal.NODE_ID_CHANGED, "n1", "n1"
        )
        self.assertEqual(refused.reason, "node n1 sent a Register for n2")
        self.assertEqual([n.id for n in self.inventory.nodes()], ["n1"])
        with capturedLogs():
            link.connectionLost()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_refusal_over_the_peers_frame_maximum(self) -> None:
        """
        A registered peer that said it takes frames of 30 bytes (its
        Welcome fits, a Refused would not) and then breaks the rules is
        closed without a Refused, and without an error.
        """
        link, transport = self.connect()
        with capturedLogs():
            link.dataReceived(
                _frame(register=pb.Register(node_id="n1", max_frame_size=30))
            )
        before = transport.value()
        with capturedLogs() as events:
            link.dataReceived(_register("n2"))
        self.assertTrue(transport.disconnecting)
        self.assertEqual(transport.value(), before)
        self.assertEqual([e for e in events if e.get("log_failure")], [])
        with capturedLogs():
            link.connectionLost()

    def test_second_agent_refused_while_the_link_is_alive(self) -> None:
        """
        Another agent (another C{agent_instance}, or none) for n1 while
        n1's link was heard from within 15 s is refused, told who holds
        the node; the link stays n1's, its Welcome the only one sent.  The
        server's warning of the second refusal, 15 s after the first, is
        held back (L{RepeatedRefusalTests}).
        """
        first, first_transport = self.connect()
        with capturedLogs():
            first.dataReceived(_register("n1", "a1"))
        for instance, after in (("a2", 1.0), ("", 14.0)):
            self.clock.advance(after)
            second, transport = self.connect()
            with capturedLogs() as events:
                second.dataReceived(_register("n1", instance))
            refused = self.assert_refused(
                transport,
                list(events),
                Refusal.NODE_TAKEN,
                "n1",
                "n1",
                logged=instance == "a2",
            )
            self.assertEqual(
                refused.reason,
                "node 'n1' is linked to another agent, from 10.0.0.9:40000, heard"
                f" {after:.1f}s ago: one agent per node id; this one may take over"
                " once that link is silent for 15s",
            )
            self.assertEqual(
                [m.WhichOneof("kind") for m in _sent(transport)], ["refused"]
            )
            second.connectionLost()
            # n1's agent goes on: heard from again.
            first.dataReceived(_frame(heartbeat=pb.Heartbeat()))
        self.assertIs(self.hub.links["n1"], first)
        self.assertFalse(first_transport.disconnecting)
        self.assertTrue(self.inventory.nodes()[0].connected)
        self.assertEqual(self.hub.reconnects, 0)
        with capturedLogs():
            first.connectionLost()

    def test_silent_link_taken_over(self) -> None:
        """
        Once n1's link has been silent for 15 s, another agent takes it
        over: it is welcomed, the silent link is told it was replaced and
        closed, and its close does not disconnect the node.
        """
        first, first_transport = self.connect()
        with capturedLogs():
            first.dataReceived(_register("n1", "a1"))
        self.clock.advance(14.9)
        early, early_transport = self.connect()
        with capturedLogs():
            early.dataReceived(_register("n1", "a2"))
            early.connectionLost()
        self.assertEqual(_sent(early_transport)[-1].refused.code, "node_taken")
        self.clock.advance(0.1)
        second, transport = self.connect()
        with capturedLogs() as events:
            second.dataReceived(_register("n1", "a2"))
        self.assertEqual(_sent(transport)[0].WhichOneof("kind"), "welcome")
        self.assertIs(self.hub.links["n1"], second)
        told = _sent(first_transport)[-1].refused
        self.assertEqual(
            (told.code, told.reason, told.certificate_name, told.node_id),
            (
                "replaced",
                "node 'n1' was silent for 15.0s: another agent took over",
                "n1",
                "n1",
            ),
        )
        self.assertTrue(first_transport.disconnecting)
        self.assertIn(
            "agent n1 from 10.0.0.9:40002 takes over from the link from"
            " 10.0.0.9:40000, silent for 15.0s",
            [formatEvent(e) for e in events],
        )
        with capturedLogs():
            first.connectionLost()
        self.assertTrue(self.inventory.nodes()[0].connected)
        with capturedLogs():
            second.connectionLost()
        self.assertEqual(self.clock.getDelayedCalls(), [])


REFUSED = encode_frame(
    pb.ControlMessage(
        refused=pb.Refused(
            code="certificate_mismatch",
            reason="certificate CN 'gpu-01' claims to be node 'gpu-02'",
            certificate_name="gpu-01",
            node_id="gpu-02",
        )
    ).SerializeToString()
)
WELCOME = encode_frame(
    pb.ControlMessage(welcome=pb.Welcome(server_version="t")).SerializeToString()
)


class AgentRefusalTests(SynchronousTestCase):
    """
    The agent's end: a C{Refused} is warned of once per kind, naming the
    certificate and the claim; the uplink's delays grow meanwhile.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.endpoint = _Endpoint()
        self.factory = AgentFactory(
            lambda: pb.Register(node_id="gpu-02"),
            pb.Heartbeat,
            cast(IEngineReactor, self.clock),
            tempfile.mkdtemp(),
        )
        self.service = AgentService(
            self.factory, lambda _: self.endpoint, ["gw:7443"], self.clock
        )

    def refused(self, frame: bytes = REFUSED) -> float:
        """
        The server refuses the newest link and closes it.

        @return: the delay before the next attempt.
        """
        protocol = self.endpoint.connected[-1]
        protocol.dataReceived(frame)
        self.assertTrue(protocol.transport.disconnecting)
        protocol.connectionLost()
        (call,) = self.clock.getDelayedCalls()
        delay: float = call.getTime() - self.clock.seconds()
        self.clock.advance(delay)
        return delay

    def test_warned_once_per_kind_with_backoff(self) -> None:
        """
        Three refusals of one kind: one warning naming the server, the
        reason, the certificate and the claim, and delays of 1, 2 and 4 s
        (plus jitter); a refusal of another kind warns again; after a
        Welcome, so does the first kind.  Every Register carries the same
        C{agent_instance}.
        """
        with capturedLogs() as events:
            self.service.startService()
            delays = [self.refused() for _ in range(3)]
        warnings = [formatEvent(e) for e in events if e["log_level"].name == "warn"]
        self.assertEqual(
            warnings,
            [
                "the server at gw:7443 refused this agent: certificate CN 'gpu-01'"
                " claims to be node 'gpu-02' (certificate 'gpu-01', node id"
                " 'gpu-02'); check --tls-dir and --node-id; retrying"
            ],
        )
        for delay, low in zip(delays, [1.0, 2.0, 4.0], strict=True):
            self.assertTrue(low <= delay < low + 1, delays)
        self.assertEqual(
            [formatEvent(e) for e in events].count(
                "link to the server closed: refused (certificate_mismatch)"
            ),
            3,
        )
        taken = encode_frame(
            pb.ControlMessage(
                refused=pb.Refused(code="node_taken", reason="held", node_id="gpu-02")
            ).SerializeToString()
        )
        with capturedLogs() as events:
            self.refused(taken)
            self.refused(taken)
            self.endpoint.connected[-1].dataReceived(WELCOME)
            self.endpoint.connected[-1].connectionLost()
            (retry,) = self.clock.getDelayedCalls()
            self.clock.advance(retry.getTime() - self.clock.seconds())
            self.refused()
        warnings = [formatEvent(e) for e in events if e["log_level"].name == "warn"]
        self.assertEqual(len(warnings), 2, warnings)
        self.assertIn(
            "refused this agent: held (certificate none, node id 'gpu-02'); is"
            " another agent running with this node id? retrying",
            warnings[0],
        )
        self.assertIn("certificate CN 'gpu-01'", warnings[1])
        instances = {
            pb.AgentMessage.FromString(
                FrameDecoder().feed(p.transport.value())[0]
            ).register.agent_instance
            for p in self.endpoint.connected
        }
        self.assertEqual(instances, {self.factory.instance})
        self.assertEqual(len(self.factory.instance), 32)
        with capturedLogs():
            self.successResultOf(self.service.stopService())
        self.assertEqual(self.clock.getDelayedCalls(), [])


class HandshakeFailureTests(SynchronousTestCase):
    """
    A TLS handshake that fails carries no C{Refused}: the agent says what
    failed itself, once until a Welcome.
    """

    def test_sentences(self) -> None:
        """
        The server's alert (its CA did not sign this agent's certificate),
        a server certificate this agent's CA did not sign, and one that
        does not name the host dialed each get their sentence; a plain
        close gets none.
        """
        alert = Failure(SSL.Error([("SSL routines", "", "tlsv1 alert unknown ca")]))
        verify = Failure(SSL.Error([("SSL routines", "", "certificate verify failed")]))
        name = Failure(VerificationError(errors=[]))
        self.assertEqual(
            handshake_failure(alert, "gw:7443"),
            "the server refused this agent's certificate in the TLS handshake"
            " (tlsv1 alert unknown ca): is it from the fleet's CA? check --tls-dir",
        )
        self.assertEqual(
            handshake_failure(verify, "gw:7443"),
            "this agent does not trust the server's certificate (certificate verify"
            " failed): ca.pem in --tls-dir must be the fleet's CA",
        )
        self.assertEqual(
            handshake_failure(name, "[::1]:7443"),
            "the server's certificate does not name ::1, the host this agent"
            " dials: make it with llmgw certs server --host ::1",
        )
        self.assertIsNone(handshake_failure(Failure(ConnectionDone()), "gw:7443"))

    def test_warned_once(self) -> None:
        """
        Three handshakes refused alike: one warning, naming the server.
        """
        clock = Clock()
        endpoint = _Endpoint()
        factory = AgentFactory(
            pb.Register, pb.Heartbeat, cast(IEngineReactor, clock), tempfile.mkdtemp()
        )
        service = AgentService(factory, lambda _: endpoint, ["gw:7443"], clock)
        alert = Failure(SSL.Error([("SSL routines", "", "tlsv1 alert unknown ca")]))
        with capturedLogs() as events:
            service.startService()
            for _ in range(3):
                endpoint.connected[-1].connectionLost(alert)
                (retry,) = clock.getDelayedCalls()
                clock.advance(retry.getTime() - clock.seconds())
            self.successResultOf(service.stopService())
        warnings = [formatEvent(e) for e in events if e["log_level"].name == "warn"]
        self.assertEqual(len(warnings), 1, warnings)
        self.assertTrue(
            warnings[0].startswith(
                "cannot link to the server at gw:7443: the server refused this"
                " agent's certificate"
            ),
            warnings[0],
        )
        self.assertEqual(clock.getDelayedCalls(), [])


class StateLockTests(SynchronousTestCase):
    """
    One agent per state directory (L{hold_state_dir}).
    """

    def test_second_holder_refused(self) -> None:
        """
        While one holds the directory, another is refused with one line
        naming the folder and the holder's pid and program; once it is
        released, it can be taken again.
        """
        folder = os.path.join(tempfile.mkdtemp(), "agent")
        held = hold_state_dir(folder, "llmgw-server --local")
        with self.assertRaises(ConfigError) as raised:
            hold_state_dir(folder, "llmgw-agent")
        self.assertEqual(
            str(raised.exception),
            f"state_dir: {folder!r} is in use by llmgw-server --local pid"
            f" {os.getpid()}: one agent per state directory (give this one its"
            " own --state-dir)",
        )
        held.release()
        hold_state_dir(folder, "llmgw-agent").release()

    def test_pid_written_at_start(self) -> None:
        """
        The agent's service writes the pid that runs it in the lock file at
        start (twistd forks after the lock was taken).
        """
        folder = tempfile.mkdtemp()
        held = hold_state_dir(folder, "llmgw-agent")
        path = os.path.join(folder, LOCK_FILE)
        with open(path, "w") as f:
            f.write("1 the parent before the fork\n")
        clock = Clock()
        factory = AgentFactory(
            pb.Register, pb.Heartbeat, cast(IEngineReactor, clock), folder
        )
        endpoint = _Endpoint()
        service = AgentService(factory, lambda _: endpoint, ["gw:1"], clock, held)
        service.startService()
        with open(path) as f:
            self.assertEqual(f.read(), f"{os.getpid()} llmgw-agent\n")
        with capturedLogs():
            self.successResultOf(service.stopService())
        held.release()
