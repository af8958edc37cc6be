"""
Certificates made for the other end of the agent link (L{llmgw.wire.tls}):
refused where they are loaded, and, when a server presents one anyway, told
to the agent's operator with what the certificate holds, over real TLS on
loopback (L{client_options} against a listener of Twisted's
L{CertificateOptions}) and without a logged traceback (trial fails a test
that logs one).  Before, an agent's certificate as the server's was
accepted at start and gave each agent attempt a 7-line traceback and the
advice to check its CA; a server certificate of other names was told
without the names it holds.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ClientFactory, Factory, Protocol, connectionDone
from twisted.internet.ssl import Certificate, CertificateOptions, PrivateCertificate
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.agent.link import handshake_failure
from llmgw.wire import certs
from llmgw.wire.tls import (
    ServerCertificateRefused,
    TLSFileError,
    client_options,
    server_options,
)


def _fleet(hosts: list[str]) -> str:
    """
    @return: a folder with a CA, a server certificate for C{hosts} and
        gpu-01's certificate (L{llmgw.wire.certs}).
    """
    folder = tempfile.mkdtemp(prefix="llmgw-tls-")
    certs.init_ca(folder)
    certs.issue_server(folder, hosts)
    certs.issue_agent(folder, "gpu-01")
    return folder


def _without_names(folder: str) -> tuple[str, str]:
    """
    @return: the paths of a certificate for TLS servers, signed by the CA
        in C{folder}, with no subjectAltName, and of its key.
    """
    with open(os.path.join(folder, "ca.pem"), "rb") as f:
        ca = x509.load_pem_x509_certificate(f.read())
    with open(os.path.join(folder, "ca-key.pem"), "rb") as f:
        ca_key = serialization.load_pem_private_key(f.read(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gw")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path = os.path.join(folder, "bare.pem")
    key_path = os.path.join(folder, "bare-key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert_path, key_path


class RoleAtStartTests(SynchronousTestCase):
    """
    L{server_options} and L{client_options} refuse a certificate made for
    the other end, saying what it is and how to make the right one.
    """

    def setUp(self) -> None:
        self.dir = _fleet(["gw.example"])
        self.addCleanup(shutil.rmtree, self.dir)
        self.ca = os.path.join(self.dir, "ca.pem")
        self.agent = os.path.join(self.dir, "agents", "gpu-01")

    def test_agents_certificate_as_the_servers(self) -> None:
        cert = os.path.join(self.agent, "agent.pem")
        with self.assertRaises(TLSFileError) as raised:
            server_options(self.ca, cert, os.path.join(self.agent, "agent-key.pem"))
        self.assertEqual(
            str(raised.exception),
            f"{cert} is a client certificate (extended key usage clientAuth, CN"
            " 'gpu-01': an agent's?), not a server's: agents refuse it in every"
            " handshake; make the server's with llmgw certs server --host NAME (the"
            " names agents dial)",
        )

    def test_cas_certificate_as_the_servers(self) -> None:
        with self.assertRaises(TLSFileError) as raised:
            server_options(self.ca, self.ca, os.path.join(self.dir, "ca-key.pem"))
        self.assertEqual(
            str(raised.exception),
            f"{self.ca} is a CA's certificate (CN 'llmgw fleet CA'), not a"
            " server's; make the server's with llmgw certs server --host NAME (the"
            " names agents dial)",
        )

    def test_server_certificate_naming_no_host(self) -> None:
        cert, key = _without_names(self.dir)
        with self.assertRaises(TLSFileError) as raised:
            server_options(self.ca, cert, key)
        self.assertIn(
            f"{cert} names no host (no DNS name or IP address", str(raised.exception)
        )

    def test_servers_certificate_as_an_agents(self) -> None:
        cert = os.path.join(self.dir, "server.pem")
        with self.assertRaises(TLSFileError) as raised:
            client_options(
                "gw.example", self.ca, cert, os.path.join(self.dir, "server-key.pem")
            )
        self.assertEqual(
            str(raised.exception),
            f"{cert} is not an agent's certificate: its extended key usage is"
            " serverAuth, not clientAuth (CN 'gw.example'; the server's"
            " certificate?); make the agent's with llmgw certs agent --node-id ID",
        )

    def test_right_certificates_load(self) -> None:
        server_options(
            self.ca,
            os.path.join(self.dir, "server.pem"),
            os.path.join(self.dir, "server-key.pem"),
        )
        client_options(
            "gw.example",
            self.ca,
            os.path.join(self.agent, "agent.pem"),
            os.path.join(self.agent, "agent-key.pem"),
        )


class HandshakeTests(TestCase):
    """
    The agent's TLS options (L{client_options}) against a server presenting
    a given certificate, over loopback: what the agent's operator is told.
    """

    timeout = 20

    async def handshake(self, folder: str, cert: str, key: str, host: str) -> Failure:
        """
        Dial a TLS listener presenting C{cert} as an agent of C{folder}
        that dials C{host}; the server writes a byte once the handshake
        passed, and the agent closes.

        @return: why the agent's connection was lost.
        """
        with open(cert, "rb") as c, open(key, "rb") as k:
            private = PrivateCertificate.loadPEM(c.read() + k.read())
        with open(os.path.join(folder, "ca.pem"), "rb") as f:
            ca = Certificate.loadPEM(f.read())
        options = CertificateOptions(
            privateKey=private.privateKey.original,
            certificate=private.original,
            trustRoot=ca,
        )

        class Greeter(Protocol):
            def connectionMade(self) -> None:
                assert self.transport is not None
                self.transport.write(b"!")

        port = reactor.listenTCP(
            0,
            TLSMemoryBIOFactory(options, False, Factory.forProtocol(Greeter)),  # type: ignore[arg-type]
            interface="127.0.0.1",
        )
        self.addCleanup(port.stopListening)
        agent = os.path.join(folder, "agents", "gpu-01")
        lost: Deferred[list[Failure]] = Deferred()

        class Agent(Protocol):
            def dataReceived(self, data: bytes) -> None:
                assert self.transport is not None
                self.transport.loseConnection()

            def connectionLost(self, reason: Failure = connectionDone) -> None:
                # In a list: a Deferred fired with a Failure would fail.
                lost.callback([reason])

        reactor.connectTCP(
            "127.0.0.1",
            getattr(port.getHost(), "port", 0),
            TLSMemoryBIOFactory(
                client_options(
                    host,
                    os.path.join(agent, "ca.pem"),
                    os.path.join(agent, "agent.pem"),
                    os.path.join(agent, "agent-key.pem"),
                ),
                True,
                ClientFactory.forProtocol(Agent),
            ),
        )
        return (await lost)[0]

    async def test_names_held_and_dialed(self) -> None:
        """
        A server certificate for other names: the agent is told the names
        it holds and the one it dials.
        """
        folder = _fleet(["gw.example", "10.1.2.3"])
        self.addCleanup(shutil.rmtree, folder)
        reason = await self.handshake(
            folder,
            os.path.join(folder, "server.pem"),
            os.path.join(folder, "server-key.pem"),
            "127.0.0.1",
        )
        self.assertTrue(reason.check(ServerCertificateRefused), reason)
        self.assertEqual(
            handshake_failure(reason, "127.0.0.1:7443"),
            "the server's certificate names gw.example, 10.1.2.3, not 127.0.0.1, the"
            " host this agent dials (--server): dial one of those names, or make the"
            " server's certificate with llmgw certs server --host 127.0.0.1",
        )

    async def test_agents_certificate_presented_by_the_server(self) -> None:
        """
        A server presenting an agent's certificate (a server of an older
        llmgw, which accepted it at start): the agent says so, with no
        traceback logged.
        """
        folder = _fleet(["127.0.0.1"])
        self.addCleanup(shutil.rmtree, folder)
        agent = os.path.join(folder, "agents", "gpu-01")
        reason = await self.handshake(
            folder,
            os.path.join(agent, "agent.pem"),
            os.path.join(agent, "agent-key.pem"),
            "127.0.0.1",
        )
        self.assertEqual(
            handshake_failure(reason, "127.0.0.1:7443"),
            "the server's certificate is not a server's: its extended key usage is"
            " clientAuth (CN 'gpu-01': an agent's certificate as the server's"
            " [agent_tls] cert?); make the server's with llmgw certs server --host"
            " 127.0.0.1",
        )

    async def test_server_of_another_ca(self) -> None:
        """
        A server certificate of another CA is still OpenSSL's to refuse:
        the agent is told it does not trust it.
        """
        folder = _fleet(["127.0.0.1"])
        other = _fleet(["127.0.0.1"])
        self.addCleanup(shutil.rmtree, folder)
        self.addCleanup(shutil.rmtree, other)
        shutil.copy(os.path.join(other, "ca.pem"), folder)
        reason = await self.handshake(
            folder,
            os.path.join(other, "server.pem"),
            os.path.join(other, "server-key.pem"),
            "127.0.0.1",
        )
        told = handshake_failure(reason, "127.0.0.1:7443")
        assert told is not None
        self.assertTrue(told.startswith("this agent does not trust"), told)

    async def test_right_server(self) -> None:
        """
        The control: the server's own certificate for the name dialed
        passes; the link ends with the agent's close.
        """
        folder = _fleet(["localhost", "127.0.0.1"])
        self.addCleanup(shutil.rmtree, folder)
        for host in ("127.0.0.1", "localhost"):
            reason = await self.handshake(
                folder,
                os.path.join(folder, "server.pem"),
                os.path.join(folder, "server-key.pem"),
                host,
            )
            self.assertIsNone(handshake_failure(reason, f"{host}:7443"), reason)
