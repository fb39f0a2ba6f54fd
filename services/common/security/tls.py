"""TLS for every hop: server credentials, client channels, reload from disk.

A process has one identity: a certificate (with its Baton SPIFFE id, see
`baton_runtime.common.security.identity`), its key, and the CA bundle it trusts, given by
`--tls-cert/--tls-key/--tls-ca` (env `BATON_TLS_CERT/KEY/CA`). It serves with
them and calls other services with them. Plaintext is a mode that must be
asked for (`--plaintext`, env `BATON_PLAINTEXT=1`), and a plaintext server
refuses to bind anything but a loopback address.

Rotation without dropping sessions: the files are re-read when they change.
A server's credentials are dynamic (gRPC asks for the current ones before
every new handshake, `grpc.dynamic_ssl_server_credentials`); established
connections, and the streams on them, carry on. A client channel
(`ReloadingChannel`) checks the files at most every `check_every` seconds
(and at once after `request_reload()`, e.g. on SIGHUP) and, when they
changed, sends new calls over a fresh channel; calls and streams on the old
one run to their end (it is closed with the client). A certificate and key
that do not match (a rotation caught half written) are ignored until they
do: the previous pair stays in use.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from baton_runtime.common.observability import tracing

log = structlog.get_logger("baton.tls")

DEFAULT_CHECK_SECONDS = 10.0

# Bumped by `request_reload()`; every watcher re-checks its files when it moved.
_reload_generation = 0


def request_reload() -> None:
    """Make every certificate watcher of this process re-check its files now
    (instead of at its next periodic check). Called on SIGHUP."""
    global _reload_generation
    _reload_generation += 1


class TlsError(ValueError):
    """Certificate files missing, unreadable or not matching."""


@dataclass(frozen=True)
class TlsFiles:
    """Paths of a PEM certificate (chain), its private key and a CA bundle."""

    cert: str
    key: str
    ca: str


@dataclass(frozen=True)
class Security:
    """How a process talks: TLS with its identity, or explicit plaintext."""

    files: TlsFiles | None
    # Seconds between checks of the files for a rotation (clients).
    check_every: float = DEFAULT_CHECK_SECONDS
    # The name servers dialled by IP address are verified against (see
    # `server_name`); empty: the IP itself.
    ip_server_name: str = ""

    @classmethod
    def plaintext(cls) -> Security:
        return cls(files=None)

    @classmethod
    def tls(
        cls,
        cert: str,
        key: str,
        ca: str,
        check_every: float = DEFAULT_CHECK_SECONDS,
        ip_server_name: str = "",
    ) -> Security:
        return cls(TlsFiles(cert, key, ca), check_every, ip_server_name)

    @property
    def is_tls(self) -> bool:
        return self.files is not None


@dataclass(frozen=True)
class Material:
    """The loaded bytes of one version of the files."""

    cert: bytes
    key: bytes
    ca: bytes


def load_material(files: TlsFiles) -> Material:
    """Read the three files and check that the key belongs to the certificate."""
    try:
        with open(files.cert, "rb") as f:
            cert = f.read()
        with open(files.key, "rb") as f:
            key = f.read()
        with open(files.ca, "rb") as f:
            ca = f.read()
    except OSError as exc:
        raise TlsError(f"cannot read {exc.filename}: {exc.strerror}") from exc
    try:
        leaf = x509.load_pem_x509_certificate(cert)
        private = serialization.load_pem_private_key(key, password=None)
        x509.load_pem_x509_certificates(ca)
    except ValueError as exc:
        raise TlsError(f"unreadable PEM in {files.cert}, {files.key} or {files.ca}: {exc}") from exc
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.DER
    if leaf.public_key().public_bytes(encoding, public) != private.public_key().public_bytes(
        encoding, public
    ):
        raise TlsError(f"the key in {files.key} does not belong to the certificate {files.cert}")
    return Material(cert=cert, key=key, ca=ca)


def _stamp(files: TlsFiles) -> tuple[tuple[int, int, int], ...]:
    stamps = []
    for path in (files.cert, files.key, files.ca):
        try:
            st = os.stat(path)
        except OSError:
            stamps.append((0, 0, 0))
        else:
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(stamps)


class CertificateWatcher:
    """The current material of a set of files, re-read when they change."""

    def __init__(self, files: TlsFiles, check_every: float = DEFAULT_CHECK_SECONDS) -> None:
        self.files = files
        self.check_every = check_every
        self.material = load_material(files)  # fail fast at start
        self.version = 0
        self._stamp = _stamp(files)
        self._checked = time.monotonic()
        self._generation = _reload_generation
        self._lock = threading.Lock()

    def due(self) -> bool:
        return (
            self._generation != _reload_generation
            or time.monotonic() - self._checked >= self.check_every
        )

    def refresh(self) -> bool:
        """Re-read the files if they changed; True when new material is in
        use. Safe from any thread (gRPC calls the server fetcher off-loop)."""
        with self._lock:
            self._checked = time.monotonic()
            self._generation = _reload_generation
            stamp = _stamp(self.files)
            if stamp == self._stamp:
                return False
            try:
                material = load_material(self.files)
            except TlsError as exc:
                log.warning("certificate files changed but are not usable yet", error=str(exc))
                return False
            self._stamp = stamp
            if material == self.material:
                return False
            self.material = material
            self.version += 1
            log.info("certificates reloaded", cert=self.files.cert, version=self.version)
            return True


# -- servers -------------------------------------------------------------------


def server_credentials(
    security: Security, *, require_client_auth: bool
) -> tuple[grpc.ServerCredentials, CertificateWatcher]:
    """Dynamic server credentials: gRPC fetches the current certificate
    before each new handshake, so a rotation applies to new connections."""
    assert security.files is not None
    watcher = CertificateWatcher(security.files, check_every=0.0)

    def config(material: Material) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(material.key, material.cert)], root_certificates=material.ca
        )

    def fetch() -> Any:
        return config(watcher.material) if watcher.refresh() else None

    credentials = grpc.dynamic_ssl_server_credentials(
        config(watcher.material), fetch, require_client_authentication=require_client_auth
    )
    return credentials, watcher


def is_loopback(listen: str) -> bool:
    """Whether `host:port` binds only the loopback interface."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- clients -------------------------------------------------------------------


def channel_credentials(material: Material) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=material.ca, private_key=material.key, certificate_chain=material.cert
    )


def _hosts(target: str) -> list[str]:
    """The hosts a gRPC target names (none for `dns:///` and other schemes)."""
    scheme, sep, rest = target.partition(":")
    if sep and scheme in ("ipv4", "ipv6"):
        parts = rest.split(",")
    elif "://" in target or target.startswith(("dns:", "unix:")):
        return []
    else:
        parts = [target]
    return [part.rpartition(":")[0].strip("[]") for part in parts]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def server_name(target: str, ip_server_name: str = "") -> str | None:
    """The name to verify the servers of `target` against, when it is not
    what gRPC would take from the target itself.

    - Servers dialled by IP address, with `ip_server_name` set: that name.
      Owners reach other deployments' owners at the address they registered,
      a pod IP no certificate can name in advance; their certificates carry a
      name for their role (`--tls-ip-server-name`).
    - A multi-address `ipv4:`/`ipv6:` target: gRPC's default authority for it
      is not a host name, so hostname verification would fail; when every
      address has the same host (replicas on one machine: `baton up
      --replicas`, the tests), that host.
    Otherwise None: gRPC verifies the target's host (or `dns:///` name)."""
    hosts = _hosts(target)
    if not hosts:
        return None
    if ip_server_name and all(_is_ip(host) for host in hosts):
        return ip_server_name
    if len(hosts) > 1 and len(set(hosts)) == 1:
        return hosts[0]
    return None


def tls_options(
    target: str, options: Sequence[tuple[str, Any]], ip_server_name: str = ""
) -> list[tuple[str, Any]]:
    name = server_name(target, ip_server_name)
    extra = [("grpc.ssl_target_name_override", name)] if name else []
    return [*options, *extra]


def open_secure_channel(
    target: str, security: Security, options: Sequence[tuple[str, Any]]
) -> grpc.aio.Channel:
    """A channel to `target` with this process's identity, that follows
    certificate rotations (see the module doc); plaintext when so configured."""
    # Tracing's client interceptors, only while tracing is on (None: none).
    interceptors = tracing.client_interceptors()
    if security.files is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    options = tls_options(target, options, security.ip_server_name)
    watcher = CertificateWatcher(security.files, security.check_every)
    return ReloadingChannel(  # type: ignore[return-value]  # forwards every Channel method
        lambda material: grpc.aio.secure_channel(
            target, channel_credentials(material), options=options, interceptors=interceptors
        ),
        watcher,
    )


class ReloadingChannel:
    """A grpc.aio channel whose credentials follow the certificate files.

    Stubs built on it get multi-callables that, per call, use the channel of
    the current certificate version (one integer compare on the hot path; the
    files are stat'ed at most every `check_every` seconds). Replaced channels
    stay open for the calls and streams still on them; `close` closes all."""

    def __init__(
        self, make: Callable[[Material], grpc.aio.Channel], watcher: CertificateWatcher
    ) -> None:
        self._make = make
        self._watcher = watcher
        self.channel = make(watcher.material)
        self.version = watcher.version
        self._retired: list[grpc.aio.Channel] = []

    def current(self) -> grpc.aio.Channel:
        if self._watcher.due() and self._watcher.refresh():
            self._retired.append(self.channel)
            self.channel = self._make(self._watcher.material)
            self.version = self._watcher.version
        return self.channel

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> _Callable:
        return _Callable(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> _Callable:
        return _Callable(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> _Callable:
        return _Callable(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> _Callable:
        return _Callable(self, "stream_stream", method, args, kwargs)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def close(self, grace: float | None = None) -> None:
        for channel in (*self._retired, self.channel):
            await channel.close(grace)
        self._retired.clear()

    async def __aenter__(self) -> ReloadingChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Callable:
    """A multi-callable bound to whichever channel is current."""

    __slots__ = ("_owner", "_kind", "_method", "_args", "_kwargs", "_version", "_inner")

    def __init__(
        self,
        owner: ReloadingChannel,
        kind: str,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self._owner = owner
        self._kind = kind
        self._method = method
        self._args = args
        self._kwargs = kwargs
        self._version = -1
        self._inner: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self._owner.current()
        if self._version != self._owner.version or self._inner is None:
            factory = getattr(channel, self._kind)
            self._inner = factory(self._method, *self._args, **self._kwargs)
            self._version = self._owner.version
        return self._inner(*args, **kwargs)
