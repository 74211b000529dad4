"""A throwaway PKI for the TLS tests: a CA made with ``cryptography`` that issues server
and client certificates, PEM writers, cert-manager's symlink swap, and a client context
that trusts the CA. Used by tests/unit/test_tls_context.py and the TLS integration
tests (listener, gateway)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NOW = datetime.datetime.now(datetime.UTC)
DAY = datetime.timedelta(days=1)


def _name(cn: str, org: str = "Gateway Tests") -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, org),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: CertificateIssuerPrivateKeyTypes, passphrase: bytes | None = None) -> bytes:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase)
        if passphrase
        else serialization.NoEncryption()
    )
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )


@dataclass
class Issued:
    key: CertificateIssuerPrivateKeyTypes
    cert: x509.Certificate

    @property
    def serial(self) -> int:
        return int(self.cert.serial_number)


@dataclass
class Pki:
    """A CA that issues server and client certificates (EC P-256 unless told RSA)."""

    name: str = "Gateway Test CA"
    ca: Issued = field(init=False)

    def __post_init__(self) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(self.name))
            .issuer_name(_name(self.name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(NOW - DAY)
            .not_valid_after(NOW + 30 * DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
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
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        self.ca = Issued(key, cert)

    def issue(
        self,
        cn: str,
        *,
        server: bool = True,
        serial: int | None = None,
        rsa_key: bool = False,
        not_after: datetime.datetime | None = None,
    ) -> Issued:
        key: CertificateIssuerPrivateKeyTypes = (
            rsa.generate_private_key(public_exponent=65537, key_size=2048)
            if rsa_key
            else ec.generate_private_key(ec.SECP256R1())
        )
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.ca.cert.subject)
            .public_key(key.public_key())
            .serial_number(serial or x509.random_serial_number())
            .not_valid_before(NOW - DAY if not_after is None else min(NOW, not_after) - DAY)
            .not_valid_after(not_after or NOW + 10 * DAY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca.key.public_key()),
                critical=False,
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        return Issued(key, builder.sign(self.ca.key, hashes.SHA256()))

    def write_ca(self, path: Path) -> str:
        path.write_bytes(pem(self.ca.cert))
        return str(path)


def write_pair(directory: Path, issued: Issued, passphrase: bytes | None = None) -> tuple[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "tls.crt", directory / "tls.key"
    cert.write_bytes(pem(issued.cert))
    key.write_bytes(key_pem(issued.key, passphrase))
    return str(cert), str(key)


def swap_to(live: Path, target: Path) -> None:
    """cert-manager's way (a Kubernetes secret volume): ``live`` is a symlink to the
    directory of the current files; a new directory is written, then the link is
    replaced in one rename."""
    tmp = live.with_name(live.name + ".tmp")
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, live)


def client_context(
    pki: Pki | None = None, client: Issued | None = None, tmp: Path | None = None
) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if pki is not None:
        context.load_verify_locations(cadata=pem(pki.ca.cert).decode())
    if client is not None:
        assert tmp is not None
        tmp.mkdir(parents=True, exist_ok=True)
        cert, key = tmp / f"client-{client.serial}.crt", tmp / f"client-{client.serial}.key"
        cert.write_bytes(pem(client.cert))
        key.write_bytes(key_pem(client.key))
        context.load_cert_chain(str(cert), str(key))
    return context
