"""Test certificates, generated on the fly with `cryptography`: a CA and leaf certificates it signs.

    ca = CertificateAuthority.create("test CA")
    files = ca.issue("router", tmp_path)          # -> TlsFilePaths(cert, key, ca) on disk, PEM
    other = CertificateAuthority.create("another CA").issue("worker", tmp_path / "other")

Leaves are valid for 127.0.0.1, ::1 and "localhost" (plus any extra DNS names), for both server and
client authentication, so one leaf serves a process that listens and dials. EC P-256 keys: fast to make.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 2


@dataclass(frozen=True, slots=True)
class TlsFilePaths:
    cert: Path
    key: Path
    ca: Path

    def flags(self) -> list[str]:
        """The command-line flags a router or worker takes for these files."""
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, name: str) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
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
            )  # fmt: skip
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(name, key, cert)

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, common_name: str, directory: Path, dns_names: tuple[str, ...] = ()) -> TlsFilePaths:
        """A leaf for `common_name` signed by this CA, written with the CA's certificate into `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        names: list[x509.GeneralName] = [x509.DNSName(n) for n in ("localhost", *dns_names)]
        names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        paths = TlsFilePaths(
            directory / f"{common_name}.crt", directory / f"{common_name}.key", directory / "ca.crt"
        )
        paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths.key.write_bytes(_pem_key(key))
        paths.key.chmod(0o600)
        paths.ca.write_bytes(self.pem)
        return paths
