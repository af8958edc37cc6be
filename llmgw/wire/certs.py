"""
Certificate issuing for the mutually authenticated agent link
(L{llmgw.wire.tls}): the fleet CA, the server's certificate and each agent's.  Used
by C{llmgw certs} (L{llmgw.cli.certs}) and by C{llmgw-server --local}
(L{llmgw.server.local}), which makes its own on first start.  The functions
and the files they write::

    init_ca(D)                 D/ca.pem, D/ca-key.pem
    issue_server(D, [NAME])    D/server.pem, D/server-key.pem
    issue_agent(D, ID)         D/agents/ID/{ca,agent,agent-key}.pem

Keys are ECDSA P-256, written PEM with mode 0600; certificates PEM.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# What a node id may be: it names a folder and is a certificate's CN.
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_HOST = re.compile(
    r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9-]{1,63})*\.?$"
)


class CertsError(Exception):
    """
    A certificate cannot be made as asked; the message says why.
    """


def _write(path: str, data: bytes, private: bool) -> None:
    # Created with its final mode: a key is never readable by others, not
    # even for a moment.
    # No following a link planted where a key goes.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    fd = os.open(path, flags, 0o600 if private else 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    if private:
        os.chmod(path, 0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_ca(directory: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    path = os.path.join(directory, "ca.pem")
    try:
        with open(path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        path = os.path.join(directory, "ca-key.pem")
        with open(path, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), None)
    except FileNotFoundError as e:
        raise CertsError(
            f"no CA in {directory}: {e.filename} is missing;"
            f" run llmgw certs init --dir {directory}"
        ) from None
    except OSError as e:
        raise CertsError(f"{path}: cannot read: {e.strerror or e}") from None
    except (ValueError, TypeError):
        raise CertsError(
            f"{path}: not PEM (or a key with a passphrase); make a new CA with"
            f" llmgw certs init --dir {directory} --force"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertsError(f"{directory}/ca-key.pem is not an EC key")
    return cert, key


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def init_ca(directory: str, days: int = 3650, force: bool = False) -> str:
    """
    Make the fleet CA.

    @return: the CA certificate's path.
    @raise CertsError: a CA key exists and C{force} is false (replacing it
        would orphan every certificate it signed).
    """
    os.makedirs(directory, exist_ok=True)
    key_path = os.path.join(directory, "ca-key.pem")
    if os.path.exists(key_path) and not force:
        raise CertsError(
            f"{key_path} exists; every certificate of the fleet chains to it"
            " (--force replaces it)"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmgw fleet CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _key_pem(key), private=True)
    cert_path = os.path.join(directory, "ca.pem")
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return cert_path


def _issue(
    directory: str,
    common_name: str,
    names: list[x509.GeneralName],
    usage: x509.ObjectIdentifier,
    days: int,
) -> tuple[bytes, bytes, bytes]:
    ca_cert, ca_key = _load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(names), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    return (
        _key_pem(key),
        cert.public_bytes(serialization.Encoding.PEM),
        ca_cert.public_bytes(serialization.Encoding.PEM),
    )


def issue_server(directory: str, hosts: list[str], days: int = 825) -> str:
    """
    Make the server's certificate for C{hosts} (DNS names or IP addresses,
    the names agents dial).

    @return: the certificate's path.
    @raise CertsError: no host, or no CA in C{directory}.
    """
    hosts = [h.strip() for h in hosts if h.strip()]
    if not hosts:
        raise CertsError("--host: give at least one DNS name or IP address")
    names: list[x509.GeneralName] = []
    for host in hosts:
        bare = host.removeprefix("[").removesuffix("]")
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(bare)))
            continue
        except ValueError:
            pass
        try:
            # Internationalized names go in as A-labels (RFC 5280).
            ascii_name = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise CertsError(f"--host: bad name {host!r}") from None
        if not _HOST.match(ascii_name):
            raise CertsError(f"--host: bad name {host!r}")
        names.append(x509.DNSName(ascii_name))
    # A CN holds at most 64 characters; the SAN is what clients check.
    key, cert, _ = _issue(
        directory, hosts[0][:64], names, ExtendedKeyUsageOID.SERVER_AUTH, days
    )
    _write(os.path.join(directory, "server-key.pem"), key, private=True)
    path = os.path.join(directory, "server.pem")
    _write(path, cert, private=False)
    return path


def issue_agent(directory: str, node_id: str, days: int = 825) -> str:
    """
    Make a node's certificate, CN = C{node_id}, in C{directory/agents/ID/}
    with a copy of the CA certificate: the folder to copy to that node.

    @return: the folder.
    @raise CertsError: a node id that cannot be a folder name and CN, or no
        CA in C{directory}.
    """
    if not NODE_ID.match(node_id):
        raise CertsError(
            f"--node-id: bad value {node_id!r}: letters, digits, '.', '_', '-',"
            " at most 63 characters, not starting with a punctuation mark"
        )
    key, cert, ca = _issue(
        directory, node_id, [], ExtendedKeyUsageOID.CLIENT_AUTH, days
    )
    folder = os.path.join(directory, "agents", node_id)
    os.makedirs(folder, exist_ok=True)
    _write(os.path.join(folder, "agent-key.pem"), key, private=True)
    _write(os.path.join(folder, "agent.pem"), cert, private=False)
    _write(os.path.join(folder, "ca.pem"), ca, private=False)
    return folder
