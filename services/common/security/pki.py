"""A throwaway certificate authority for local runs and tests.

`baton up` and the test stack create one at start: a CA, then one
certificate per role (and per deployment for owners and ingresses), each
with its SPIFFE id as the only URI SAN (`baton_runtime.common.security.identity`), the
loopback names as DNS/IP SANs, and both server and client auth usage, so one
file pair serves and calls. etcd gets a server certificate and its users get
client certificates whose common name is the etcd user name (etcd maps a
client certificate's CN to its user when auth is on).

Production certificates come from the operator's own CA (e.g. cert-manager);
they need the same SPIFFE URI SAN.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from baton_runtime.common.security.identity import Role, spiffe_id
from baton_runtime.common.security.tls import Security, TlsFiles

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_VALIDITY = datetime.timedelta(days=7)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    """Write atomically (rename), so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _sans(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


@dataclass
class CertificateAuthority:
    """A CA whose key lives in memory and whose certificate is in `directory`."""

    directory: Path
    # Distinct per CA (a rotation's bundle holds two; chains are built by name).
    name: str = field(default_factory=lambda: f"Baton throwaway CA {os.urandom(4).hex()}")
    validity: datetime.timedelta = DEFAULT_VALIDITY
    key: ec.EllipticCurvePrivateKey = field(default_factory=_key)
    cert: x509.Certificate | None = None
    # Write ca.crt (False while rotating: the caller writes the bundle).
    write_ca: bool = True

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.cert is None:
            now = datetime.datetime.now(datetime.UTC)
            subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.name)])
            self.cert = (
                x509.CertificateBuilder()
                .subject_name(subject)
                .issuer_name(subject)
                .public_key(self.key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + self.validity)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(
                    x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()),
                    critical=False,
                )
                .add_extension(
                    x509.KeyUsage(
                        digital_signature=True,
                        key_cert_sign=True,
                        crl_sign=True,
                        content_commitment=False,
                        key_encipherment=False,
                        data_encipherment=False,
                        key_agreement=False,
                        encipher_only=False,
                        decipher_only=False,
                    ),
                    critical=True,
                )
                .sign(self.key, hashes.SHA256())
            )
        if self.write_ca:
            _write(self.ca_path, _pem_cert(self.cert))

    @property
    def pem(self) -> bytes:
        assert self.cert is not None
        return _pem_cert(self.cert)

    @property
    def ca_path(self) -> Path:
        return self.directory / "ca.crt"

    def issue(
        self,
        name: str,
        *,
        common_name: str = "",
        uri: str = "",
        hosts: Sequence[str] = LOOPBACK_HOSTS,
        server: bool = True,
        client: bool = True,
        validity: datetime.timedelta | None = None,
    ) -> TlsFiles:
        """Issue `name.crt`/`name.key` (key mode 0600), replacing old ones."""
        assert self.cert is not None
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        sans = _sans(hosts)
        if uri:
            sans.insert(0, x509.UniformResourceIdentifier(uri))
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name or name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + (validity or self.validity))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_path = self.directory / f"{name}.crt"
        key_path = self.directory / f"{name}.key"
        # Key first, then certificate: a reader that sees the new certificate
        # also finds its key (and ignores a mismatched pair meanwhile).
        _write(key_path, _pem_key(key), private=True)
        _write(cert_path, _pem_cert(cert))
        return TlsFiles(cert=str(cert_path), key=str(key_path), ca=str(self.ca_path))

    def issue_role(
        self,
        role: Role,
        deployment_id: str = "",
        *,
        hosts: Sequence[str] = LOOPBACK_HOSTS,
        name: str = "",
    ) -> TlsFiles:
        """A certificate naming `role` (and deployment), CN = the file name."""
        name = name or (f"{role.value}-{deployment_id}" if deployment_id else role.value)
        return self.issue(name, uri=spiffe_id(role, deployment_id), hosts=hosts)


class LocalPki:
    """One CA and the certificates of a local system, issued on demand."""

    def __init__(self, directory: str | Path, *, check_every: float = 1.0) -> None:
        self.ca = CertificateAuthority(Path(directory))
        self.check_every = check_every
        self._issued: dict[tuple[Role, str], TlsFiles] = {}
        self._etcd: dict[str, TlsFiles] = {}
        self._retiring: CertificateAuthority | None = None

    # A CA rotation, in the order every process can follow without a failed
    # handshake: trust both CAs, then reissue every certificate from the new
    # one, then stop trusting the old one (wait for the processes' reload
    # checks in between). The files keep their paths.

    def trust_new_ca(self) -> None:
        """Step 1: a new CA; the bundle (ca.crt) holds the old and the new."""
        new = CertificateAuthority(self.ca.directory, write_ca=False)
        _write(self.ca.ca_path, self.ca.pem + new.pem)
        self._retiring, self.ca = self.ca, new

    def reissue(self) -> None:
        """Step 2: every certificate issued so far, again, by the current CA."""
        for role, deployment_id in list(self._issued):
            self._issued[(role, deployment_id)] = self.ca.issue_role(role, deployment_id)
        self._etcd.clear()

    def retire_old_ca(self) -> None:
        """Step 3: the bundle holds the current CA only."""
        _write(self.ca.ca_path, self.ca.pem)
        self._retiring = None

    @property
    def ca_path(self) -> str:
        return str(self.ca.ca_path)

    def files(self, role: Role, deployment_id: str = "") -> TlsFiles:
        key = (role, deployment_id)
        if key not in self._issued:
            self._issued[key] = self.ca.issue_role(role, deployment_id)
        return self._issued[key]

    def security(self, role: Role, deployment_id: str = "") -> Security:
        files = self.files(role, deployment_id)
        return Security(files=files, check_every=self.check_every)

    def etcd_server(self) -> TlsFiles:
        if "server" not in self._etcd:
            self._etcd["server"] = self.ca.issue("etcd-server", client=False)
        return self._etcd["server"]

    def etcd_user(self, user: str) -> TlsFiles:
        """A client certificate whose CN is the etcd user `user`."""
        if user not in self._etcd:
            self._etcd[user] = self.ca.issue(
                f"etcd-user-{user}", common_name=user, hosts=(), server=False
            )
        return self._etcd[user]
