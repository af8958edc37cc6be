"""
TLS options for the agent link, from PEM files (docs/architecture.md, "Wire
protocol"): the
server demands a client certificate from the fleet CA; the agent checks the
server's certificate against the CA and the host name it dials.
"""

from __future__ import annotations

from twisted.internet.interfaces import IOpenSSLClientConnectionCreator
from twisted.internet.ssl import (
    Certificate,
    CertificateOptions,
    PrivateCertificate,
    optionsForClientTLS,
)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_options(ca: str, cert: str, key: str) -> CertificateOptions:
    """
    @param ca: the fleet CA certificate, PEM path.
    @param cert: the server's certificate, PEM path.
    @param key: the server's private key, PEM path.
    @return: options that present the server's certificate and require a
        client certificate chaining to C{ca} (refusing none or a foreign
        one during the handshake).
    @raise OSError: a file cannot be read.
    """
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
        server's against C{ca} and C{host}.
    @raise OSError: a file cannot be read.
    """
    return optionsForClientTLS(
        host,
        trustRoot=Certificate.loadPEM(_read(ca)),
        clientCertificate=PrivateCertificate.loadPEM(_read(cert) + _read(key)),
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
    from cryptography.x509.oid import NameOID

    names = peer.to_cryptography().subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else None
