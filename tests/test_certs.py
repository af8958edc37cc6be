"""
C{llmgw certs}, run as the console script, and its certificates used for a
real mutually authenticated TLS connection.
"""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from collections.abc import Generator
from typing import Any

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from twisted.internet import defer, reactor
from twisted.internet.endpoints import SSL4ClientEndpoint, SSL4ServerEndpoint
from twisted.internet.interfaces import IHandshakeListener
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import (
    Certificate,
    CertificateOptions,
    PrivateCertificate,
    optionsForClientTLS,
)
from twisted.trial.unittest import TestCase
from zope.interface import implementer

from tests.support import BIN, hermetic_env

LLMGW = os.path.join(BIN, "llmgw")


def certs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LLMGW, "certs", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=hermetic_env(),
    )


def load(path: str) -> x509.Certificate:
    with open(path, "rb") as f:
        return x509.load_pem_x509_certificate(f.read())


def make_fleet(directory: str, node: str = "gpu-01") -> None:
    for args in (
        ["init", "--dir", directory],
        ["server", "--dir", directory, "--host", "localhost,127.0.0.1"],
        ["agent", "--dir", directory, "--node-id", node],
    ):
        done = certs(*args)
        assert done.returncode == 0, done.stderr


class CertsCommandTests(TestCase):
    timeout = 60

    def test_files_chain_and_modes(self) -> None:
        """
        init, server and agent write PEM files where the issue says, keys
        0600, certificates signed by the CA, the agent's CN its node id and
        the server's names in its SAN.
        """
        d = tempfile.mkdtemp()
        make_fleet(d)
        ca = load(os.path.join(d, "ca.pem"))
        server = load(os.path.join(d, "server.pem"))
        agent_dir = os.path.join(d, "agents", "gpu-01")
        agent = load(os.path.join(agent_dir, "agent.pem"))
        for cert in (server, agent):
            cert.verify_directly_issued_by(ca)
        self.assertEqual(load(os.path.join(agent_dir, "ca.pem")), ca)
        (cn,) = agent.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        self.assertEqual(cn.value, "gpu-01")
        san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        self.assertEqual(san.value.get_values_for_type(x509.DNSName), ["localhost"])
        self.assertEqual(
            [str(a) for a in san.value.get_values_for_type(x509.IPAddress)],
            ["127.0.0.1"],
        )
        eku = agent.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
        self.assertIn(ExtendedKeyUsageOID.CLIENT_AUTH, eku.value)
        for key in (
            os.path.join(d, "ca-key.pem"),
            os.path.join(d, "server-key.pem"),
            os.path.join(agent_dir, "agent-key.pem"),
        ):
            self.assertEqual(stat.S_IMODE(os.stat(key).st_mode), 0o600, key)

    def test_refusals(self) -> None:
        """
        A second init without --force, a node id that cannot be a CN or a
        folder, and no CA yet: exit 1 with one line that says why.
        """
        d = tempfile.mkdtemp()
        missing = certs("agent", "--dir", d, "--node-id", "n1")
        self.assertEqual(missing.returncode, 1)
        self.assertIn("llmgw certs init", missing.stderr)
        make_fleet(d)
        again = certs("init", "--dir", d)
        self.assertEqual(again.returncode, 1)
        self.assertIn("--force", again.stderr)
        bad = certs("agent", "--dir", d, "--node-id", "../etc")
        self.assertEqual(bad.returncode, 1)
        self.assertIn("'../etc'", bad.stderr)
        for done in (missing, again, bad):
            self.assertEqual(len(done.stderr.strip().splitlines()), 1)


@implementer(IHandshakeListener)
class _Peer(Protocol):
    def __init__(self, seen: defer.Deferred[str | None]) -> None:
        self.seen = seen

    def handshakeCompleted(self) -> None:
        peer = self.transport.getPeerCertificate()  # type: ignore[union-attr]
        cn = None
        if peer is not None:
            name = peer.to_cryptography().subject
            cn = name.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        if not self.seen.called:
            self.seen.callback(cn)

    def connectionLost(self, reason: object = None) -> None:
        if not self.seen.called:
            self.seen.errback(reason)  # type: ignore[arg-type]


class MutualTLSTests(TestCase):
    """
    The certificates do what they are for, on Twisted's TLS as
    docs/architecture.md ("Wire protocol") describes it, over loopback.
    """

    timeout = 30

    def _options(self, d: str) -> tuple[CertificateOptions, Certificate]:
        with open(os.path.join(d, "ca.pem"), "rb") as f:
            ca = Certificate.loadPEM(f.read())
        with open(os.path.join(d, "server.pem"), "rb") as f:
            cert = f.read()
        with open(os.path.join(d, "server-key.pem"), "rb") as f:
            key = f.read()
        server = PrivateCertificate.loadPEM(cert + key)
        return (
            CertificateOptions(
                privateKey=server.privateKey.original,
                certificate=server.original,
                trustRoot=ca,
            ),
            ca,
        )

    def _client(self, agent_dir: str, ca: Certificate) -> object:
        with open(os.path.join(agent_dir, "agent.pem"), "rb") as f:
            cert = f.read()
        with open(os.path.join(agent_dir, "agent-key.pem"), "rb") as f:
            key = f.read()
        return optionsForClientTLS(
            "localhost",
            trustRoot=ca,
            clientCertificate=PrivateCertificate.loadPEM(cert + key),
        )

    @defer.inlineCallbacks
    def _connect(
        self, d: str, agent_dir: str
    ) -> Generator[defer.Deferred[Any], Any, list[Any]]:
        server_options, ca = self._options(d)
        seen: defer.Deferred[str | None] = defer.Deferred()
        factory = Factory.forProtocol(lambda: _Peer(seen))
        port = yield SSL4ServerEndpoint(
            reactor, 0, server_options, interface="127.0.0.1"
        ).listen(factory)
        self.addCleanup(port.stopListening)
        client_seen: defer.Deferred[str | None] = defer.Deferred()
        endpoint = SSL4ClientEndpoint(
            reactor,
            "127.0.0.1",
            port.getHost().port,
            self._client(agent_dir, ca),
        )
        protocol = yield endpoint.connect(
            Factory.forProtocol(lambda: _Peer(client_seen))
        )
        self.addCleanup(protocol.transport.abortConnection)
        result: list[Any] = yield defer.DeferredList(
            [seen, client_seen], consumeErrors=True, fireOnOneErrback=False
        )
        return result

    @defer.inlineCallbacks
    def test_agent_accepted_and_named(
        self,
    ) -> Generator[defer.Deferred[Any], Any, None]:
        """
        An agent certificate from the fleet CA is accepted, and the server
        reads its node id from the CN after the handshake.
        """
        d = tempfile.mkdtemp()
        make_fleet(d)
        result = yield self._connect(d, os.path.join(d, "agents", "gpu-01"))
        (server_ok, server_cn), (client_ok, client_cn) = result
        self.assertTrue(server_ok and client_ok, result)
        self.assertEqual(server_cn, "gpu-01")
        self.assertEqual(client_cn, "localhost")

    @defer.inlineCallbacks
    def test_foreign_ca_refused(self) -> Generator[defer.Deferred[Any], Any, None]:
        """
        An agent certificate from another CA does not complete the handshake.
        """
        d = tempfile.mkdtemp()
        make_fleet(d)
        other = tempfile.mkdtemp()
        make_fleet(other, "gpu-01")
        result = yield self._connect(d, os.path.join(other, "agents", "gpu-01"))
        (server_ok, _), _ = result
        self.assertFalse(server_ok)
