"""
TLS options for the agent link, from PEM files (docs/architecture.md, "Wire
protocol"): the
server demands a client certificate from the fleet CA; the agent checks the
server's certificate against the CA and the host name it dials.
"""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator
from twisted.internet.ssl import (
    Certificate,
    CertificateOptions,
    PrivateCertificate,
    optionsForClientTLS,
)


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
    @raise TLSFileError: the files cannot serve (L{check_files}).
    """
    check_files(ca, cert, key)
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
    @raise TLSFileError: the files cannot serve (L{check_files}; whether
        C{ca} signed C{cert} is the server's to judge).
    """
    check_files(ca, cert, key, signed=False)
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
