"""Throwaway certificates for TLS tests: a CA, a server certificate and a client certificate.

``make_certs(folder)`` writes PEM files and returns their paths; ``issue(paths, name, ...)`` adds
a certificate from the same CA with the names a test needs (a process identity, a role). Keys are
EC P-256 (fast to make); every leaf certificate allows server and client use, as an agent is both.
Every ``make_certs`` call makes a new CA, so certificates from two calls do not trust each other
(useful to test a foreign client).

The server certificate is also the one node certificate of the agent tests' processes: it names
the processes :data:`NODE_PROCESSES` (``stablewatch://process/<id>``), so with mutual TLS each
of them may open channels as itself; the client certificate names no process.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from stablewatch.agents.certificates import TlsConfig, channel_credentials
from stablewatch.agents.peer_identity import process_uri

__all__ = ["NODE_PROCESSES", "credentials", "issue", "make_certs", "tls_config"]

_VALIDITY = dt.timedelta(days=7)
#: The process ids the shared server (node) certificate names.
NODE_PROCESSES = ("A", "B", "C")
_LOOPBACK: tuple[x509.GeneralName, ...] = (
    x509.DNSName("localhost"),
    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    x509.IPAddress(ipaddress.ip_address("::1")),
)


def make_certs(folder: Path) -> dict[str, Path]:
    """Write a CA, a server certificate (localhost, 127.0.0.1, ::1; processes A, B, C) and a client certificate.

    Returns the paths under keys ``ca_cert``, ``ca_key``, ``server_cert``, ``server_key``,
    ``client_cert`` and ``client_key``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("stablewatch test CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {
        "ca_cert": _write_cert(folder / "ca.pem", ca_cert),
        "ca_key": _write_key(folder / "ca.key", ca_key),
    }
    node_names = [*_LOOPBACK, *(x509.UniformResourceIdentifier(process_uri(p)) for p in NODE_PROCESSES)]
    paths |= issue(paths, "server", names=node_names)
    paths |= issue(paths, "client", names=[x509.DNSName("client.stablewatch.test")])
    return paths


def issue(
    paths: dict[str, Path], name: str, *, uris: Sequence[str] = (), names: Sequence[x509.GeneralName] = _LOOPBACK
) -> dict[str, Path]:
    """A new certificate and key signed by the CA of ``paths`` (from :func:`make_certs`).

    Its subject alternative names are ``names`` (by default localhost, 127.0.0.1 and ::1, so it
    can serve on loopback too) and the URIs ``uris`` (e.g. ``stablewatch://role/reader``). Written
    next to the CA; returns the paths under ``<name>_cert`` and ``<name>_key``.
    """
    ca_key = serialization.load_pem_private_key(paths["ca_key"].read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca_cert = x509.load_pem_x509_certificate(paths["ca_cert"].read_bytes())
    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [*names, *(x509.UniformResourceIdentifier(uri) for uri in uris)]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"stablewatch test {name}"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    folder = paths["ca_cert"].parent
    return {
        f"{name}_cert": _write_cert(folder / f"{name}.pem", cert),
        f"{name}_key": _write_key(folder / f"{name}.key", key),
    }


def credentials(paths: dict[str, Path], name: str | None) -> grpc.ChannelCredentials:
    """Client credentials trusting the CA of `paths` and showing certificate `name` (None: none)."""
    if name is None:
        return channel_credentials(paths["ca_cert"])
    return channel_credentials(paths["ca_cert"], paths[f"{name}_cert"], paths[f"{name}_key"])


def tls_config(paths: dict[str, Path], name: str) -> TlsConfig:
    """An agent's TLS identity: certificate `name` for both its sides, trusting the CA of `paths`."""
    return TlsConfig(paths[f"{name}_cert"], paths[f"{name}_key"], paths["ca_cert"])


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.write_bytes(pem)
    path.chmod(0o600)
    return path
