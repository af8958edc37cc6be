"""
TLS options for the agent link, from PEM files (docs/architecture.md, "Wire
protocol"): the
server demands a client certificate from the fleet CA; the agent checks the
server's certificate against the CA and the host name it dials.

A certificate made for the other end is refused where it is loaded (the
server's must be a server's and name a host, an agent's a client's), and
the agent checks the server's certificate itself in the handshake
(L{ServerCertificateRefused}), so that its operator reads which names the
certificate holds, not a traceback.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Callable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from OpenSSL import SSL
from OpenSSL.crypto import X509
from service_identity import CertificateError, VerificationError
from service_identity.cryptography import (
    verify_certificate_hostname,
    verify_certificate_ip_address,
)
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator
from twisted.internet.ssl import (
    Certificate,
    CertificateOptions,
    PrivateCertificate,
    optionsForClientTLS,
)
from twisted.protocols.tls import TLSMemoryBIOProtocol
from twisted.python.failure import Failure
from zope.interface import implementer

X509_V_ERR_INVALID_PURPOSE = 26
"""
OpenSSL's verify error for a certificate whose key usage does not allow
its role (C{x509_vfy.h}): a client certificate presented by a server.
"""

_USAGES = {
    ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
    ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
}


class TLSFileError(ValueError):
    """
    A certificate or key file that cannot serve: unreadable, not PEM, a key
    that is not the certificate's, a certificate the CA did not sign or
    out of its validity.  C{str(error)} is one line naming the file.
    """


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TLSFileError(f"{path}: cannot read: {e.strerror or e}") from None


def _certificate(path: str) -> x509.Certificate:
    data = _read(path)
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise TLSFileError(f"{path}: not a PEM certificate") from None


def _public(key: object) -> bytes:
    return key.public_bytes(  # type: ignore[attr-defined,no-any-return]
        serialization.Encoding.DER,
        serialization.PublicFormat.SubjectPublicKeyInfo,
    )


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    if cert.issuer != ca.subject:
        return False
    public = ca.public_key()
    algorithm = cert.signature_hash_algorithm
    try:
        if isinstance(public, ec.EllipticCurvePublicKey) and algorithm is not None:
            public.verify(
                cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(algorithm)
            )
        elif isinstance(public, rsa.RSAPublicKey) and algorithm is not None:
            public.verify(
                cert.signature,
                cert.tbs_certificate_bytes,
                padding.PKCS1v15(),
                algorithm,
            )
        else:
            # Another kind of CA key: left to the TLS handshake.
            return True
    except InvalidSignature:
        return False
    return True


def check_files(ca: str, cert: str, key: str, signed: bool = True) -> None:
    """
    Check at start what a TLS handshake would otherwise find later, or
    what would end in a traceback: each file readable and PEM, C{key} the
    private key of C{cert}, C{cert} valid now and (with C{signed}) signed
    by C{ca}.

    @param ca: the fleet CA certificate, PEM path.
    @param cert: a certificate the fleet CA issued, PEM path.
    @param key: its private key, PEM path.
    @param signed: check that C{ca} signed C{cert}.  The server's own
        certificate must be (else every agent's handshake fails later); an
        agent's is the server's to judge, and the agent names the CA when
        the server refuses it in the handshake.
    @raise TLSFileError: the first that is not so, naming its file.
    """
    authority = _certificate(ca)
    certificate = _certificate(cert)
    data = _read(key)
    try:
        private = serialization.load_pem_private_key(data, None)
    except (ValueError, TypeError):
        raise TLSFileError(
            f"{key}: not a PEM private key (or one with a passphrase)"
        ) from None
    if _public(private.public_key()) != _public(certificate.public_key()):
        raise TLSFileError(f"{key} is not the private key of the certificate {cert}")
    if signed and not _signed_by(certificate, authority):
        raise TLSFileError(f"{cert} is not signed by the CA {ca}")
    now = datetime.datetime.now(datetime.UTC)
    begins, ends = certificate.not_valid_before_utc, certificate.not_valid_after_utc
    if now < begins:
        raise TLSFileError(f"{cert} is not valid before {begins:%Y-%m-%d %H:%M} UTC")
    if now > ends:
        raise TLSFileError(f"{cert} expired on {ends:%Y-%m-%d %H:%M} UTC")


def server_options(ca: str, cert: str, key: str) -> CertificateOptions:
    """
    @param ca: the fleet CA certificate, PEM path.
    @param cert: the server's certificate, PEM path.
    @param key: the server's private key, PEM path.
    @return: options that present the server's certificate and require a
        client certificate chaining to C{ca} (refusing none or a foreign
        one during the handshake).
    @raise TLSFileError: the files cannot serve (L{check_files}), or the
        certificate is not a server's (L{check_role}).
    """
    check_files(ca, cert, key)
    check_role(cert, server=True)
    server = PrivateCertificate.loadPEM(_read(cert) + _read(key))
    return CertificateOptions(
        privateKey=server.privateKey.original,
        certificate=server.original,
        trustRoot=Certificate.loadPEM(_read(ca)),
    )


def client_options(
    host: str, ca: str, cert: str, key: str
) -> IOpenSSLClientConnectionCreator:
    """
    @param host: the server's name as the agent dials it; its certificate
        must carry it (DNS name or IP address).
    @return: options presenting the agent's certificate and verifying the
        server's against C{ca} and C{host}; a server certificate refused
        for its role or names fails the handshake with
        L{ServerCertificateRefused}.
    @raise TLSFileError: the files cannot serve (L{check_files}; whether
        C{ca} signed C{cert} is the server's to judge), or C{cert} is not a
        client's (L{check_role}).
    """
    check_files(ca, cert, key, signed=False)
    check_role(cert, server=False)
    return _ServerNameCheck(
        optionsForClientTLS(
            host,
            trustRoot=Certificate.loadPEM(_read(ca)),
            clientCertificate=PrivateCertificate.loadPEM(_read(cert) + _read(key)),
        ),
        host,
    )


def peer_common_name(transport: object) -> str | None:
    """
    @return: the CN of the peer's certificate on a TLS C{transport}, or
        L{None} without one.  Read through C{to_cryptography()}:
        C{X509.get_subject()} is deprecated in pyOpenSSL 26.
    """
    get = getattr(transport, "getPeerCertificate", None)
    peer = get() if get is not None else None
    if peer is None:
        return None
    names = peer.to_cryptography().subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else None


def _common_name(certificate: x509.Certificate) -> str:
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def _usages(certificate: x509.Certificate) -> list[x509.ObjectIdentifier] | None:
    """
    @return: the certificate's extended key usages, L{None} without the
        extension (any use).
    """
    try:
        found = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    except x509.ExtensionNotFound:
        return None
    return list(found.value)


def _usage_text(usages: list[x509.ObjectIdentifier]) -> str:
    return ", ".join(_USAGES.get(u, u.dotted_string) for u in usages) or "none"


def _host_names(certificate: x509.Certificate) -> list[str]:
    """
    @return: the DNS names and IP addresses of its subjectAltName, in order.
    """
    try:
        found = certificate.extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        )
    except x509.ExtensionNotFound:
        return []
    names: list[str] = list(found.value.get_values_for_type(x509.DNSName))
    names += [str(a) for a in found.value.get_values_for_type(x509.IPAddress)]
    return names


def _allows(certificate: x509.Certificate, usage: x509.ObjectIdentifier) -> bool:
    usages = _usages(certificate)
    return (
        usages is None
        or usage in usages
        or ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE in usages
    )


def check_role(path: str, server: bool) -> None:
    """
    Check that a certificate is made for its end of the link: the
    server's for TLS servers (extended key usage C{serverAuth}, not a
    CA's) naming a host (a DNS name or IP address in its subjectAltName:
    agents check the name they dial against it, and with none every
    handshake fails); an agent's for TLS clients (C{clientAuth}).  Each
    end's peer would refuse it in every handshake otherwise.

    @param path: the certificate, PEM path (readable: L{check_files} ran).
    @param server: whether it is to be the server's, else an agent's.
    @raise TLSFileError: it is not, saying what it is and how to make the
        right one.
    """
    certificate = _certificate(path)
    cn = _common_name(certificate)
    usages = _usages(certificate) or []
    if not server:
        if not _allows(certificate, ExtendedKeyUsageOID.CLIENT_AUTH):
            raise TLSFileError(
                f"{path} is not an agent's certificate: its extended key usage is"
                f" {_usage_text(usages)}, not clientAuth (CN {cn!r}; the server's"
                " certificate?); make the agent's with llmgw certs agent --node-id ID"
            )
        return
    try:
        constraints = certificate.extensions.get_extension_for_class(
            x509.BasicConstraints
        ).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is not None and constraints.ca:
        raise TLSFileError(
            f"{path} is a CA's certificate (CN {cn!r}), not a server's; make the"
            " server's with llmgw certs server --host NAME (the names agents dial)"
        )
    if not _allows(certificate, ExtendedKeyUsageOID.SERVER_AUTH):
        raise TLSFileError(
            f"{path} is a client certificate (extended key usage"
            f" {_usage_text(usages)}, CN {cn!r}: an agent's?), not a server's:"
            " agents refuse it in every handshake; make the server's with llmgw"
            " certs server --host NAME (the names agents dial)"
        )
    if not _host_names(certificate):
        raise TLSFileError(
            f"{path} names no host (no DNS name or IP address in a"
            f" subjectAltName; CN {cn!r}): agents check the name they dial"
            " against it and would refuse it in every handshake; make the"
            " server's with llmgw certs server --host NAME (the names agents dial)"
        )


class ServerCertificateRefused(Exception):
    """
    The agent refused the server's certificate in the TLS handshake: made
    for a client, or not naming the host dialed.  C{str(error)} is the
    sentence for the agent's operator: what the certificate holds, the
    name dialed, and what to do.
    """


def server_certificate_problem(
    certificate: x509.Certificate, host: str, invalid_purpose: bool = False
) -> str | None:
    """
    What is wrong with the server's certificate for an agent dialing
    C{host}, by the rules of L{twisted.internet.ssl.optionsForClientTLS}
    (the subjectAltName's DNS names or IP addresses, checked by
    C{service_identity}; the CN is not read).

    @param certificate: the server's certificate (the chain's leaf).
    @param host: the name or address the agent dials.
    @param invalid_purpose: OpenSSL found its purpose not a server's.
    @return: the sentence, or L{None} when nothing is.
    """
    cn = _common_name(certificate)
    if invalid_purpose or not _allows(certificate, ExtendedKeyUsageOID.SERVER_AUTH):
        return (
            "the server's certificate is not a server's: its extended key usage"
            f" is {_usage_text(_usages(certificate) or [])} (CN {cn!r}: an agent's"
            " certificate as the server's [agent_tls] cert?); make the server's"
            f" with llmgw certs server --host {host}"
        )
    try:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            verify_certificate_hostname(certificate, host)
        else:
            verify_certificate_ip_address(certificate, host)
    except (VerificationError, CertificateError):
        names = _host_names(certificate)
        held = ", ".join(names) if names else "no host (no subjectAltName)"
        return (
            f"the server's certificate names {held}, not {host}, the host this"
            " agent dials (--server): dial one of those names, or make the"
            f" server's certificate with llmgw certs server --host {host}"
        )
    return None


@implementer(IOpenSSLClientConnectionCreator)
class _ServerNameCheck:
    """
    Twisted's client TLS options with the server's certificate checked by
    L{server_certificate_problem} instead of Twisted's own host check,
    which gives a certificate without a subjectAltName (an agent's) a
    logged traceback per handshake, and an agent's certificate only
    "certificate verify failed".  The chain is still checked by OpenSSL
    against the CA: its other errors fail the handshake as before.
    """

    def __init__(self, options: IOpenSSLClientConnectionCreator, host: str) -> None:
        self._options = options
        self._host = host

    def clientConnectionForTLS(
        self, tlsProtocol: TLSMemoryBIOProtocol
    ) -> SSL.Connection:
        connection = self._options.clientConnectionForTLS(tlsProtocol)
        connection.set_verify(
            SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT,
            self._verifier(tlsProtocol),
        )
        return connection

    def _verifier(
        self, tls: TLSMemoryBIOProtocol
    ) -> Callable[[SSL.Connection, X509, int, int, int], bool]:
        protocol: TLSMemoryBIOProtocol | None = tls

        def verify(
            connection: SSL.Connection, cert: X509, error: int, depth: int, ok: int
        ) -> bool:
            nonlocal protocol
            if depth != 0 or protocol is None:
                return bool(ok)
            purpose = not ok and error == X509_V_ERR_INVALID_PURPOSE
            if not ok and not purpose:
                return False  # the chain: OpenSSL's error ends the handshake
            why = server_certificate_problem(
                cert.to_cryptography(), self._host, purpose
            )
            # As Twisted does for its own check: no reference to the
            # protocol kept, and the reason the handshake ends with.
            tls, protocol = protocol, None
            if why is None:
                return True
            tls.failVerification(Failure(ServerCertificateRefused(why)))
            return False

        return verify
