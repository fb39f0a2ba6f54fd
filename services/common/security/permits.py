"""Transfer permits: the current owner's signed consent to move its session.

A handoff's `Transfer` is called by the successor (docs/design.md §6), so hooks
never sees the current owner on that call, and a successor's certificate
only proves where the session is going. The current owner therefore signs a
`TransferGrant` — this fence, this handoff, this checkpoint, to this
deployment — with the private key of its own certificate and sends it along
with its offer; the successor passes it to hooks unchanged. Hooks accepts a
trigger's or a drain's transfer only with a permit whose certificate chains
to the CA it trusts, names an owner of the session's current deployment
(`DeploymentScope`), and whose grant is exactly the request. So an owner of
one deployment cannot move another deployment's session however much of it
it can read; adoption (no permit: its owner is gone) is bound instead by the
compare that the old deployment has no live instance (hooks/transfer.py).

In plaintext mode there is no certificate to sign with or to check, as
there are no roles: permits are neither made nor required.
"""

from __future__ import annotations

import datetime
from collections import OrderedDict

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from google.protobuf.message import DecodeError

from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common.errors import BatonError, InvalidArgument, PermissionDenied, Reason
from baton_runtime.common.security.identity import Caller, Role
from baton_runtime.common.security.tls import CertificateWatcher, Material, Security

_CACHE_SIZE = 1_000
# Bounds of a permit's fields (a grant is ~200 B, an ECDSA or RSA-4096
# signature at most 512 B, a leaf certificate a few KiB).
MAX_GRANT_BYTES = 2_048
MAX_SIGNATURE_BYTES = 1_024
MAX_CERTIFICATE_BYTES = 16_384
# A certificate's validity is checked with this much leeway for clock skew.
_SKEW = datetime.timedelta(minutes=5)


def _refused(why: str) -> PermissionDenied:
    return PermissionDenied(Reason.TRANSFER_NOT_PERMITTED, f"transfer not permitted: {why}")


def grant_for(
    fence: s.Fence,
    handoff_id: str,
    successor_deployment_id: str,
    snapshot_revision: int,
    reason: s.TransferReason.ValueType,
) -> s.TransferGrant:
    """The grant one handoff needs (UNSPECIFIED reasons are triggers)."""
    return s.TransferGrant(
        session_id=fence.session_id,
        owner_run_id=fence.owner_run_id,
        epoch=fence.epoch,
        handoff_id=handoff_id,
        successor_deployment_id=successor_deployment_id,
        snapshot_revision=snapshot_revision,
        reason=reason or s.TRANSFER_REASON_TRIGGER,
    )


class _Files:
    """This process's certificate files, re-read when they rotate."""

    def __init__(self, security: Security) -> None:
        files = security.files
        self.watcher = (
            CertificateWatcher(files, security.check_every) if files is not None else None
        )
        self._version = -1

    def changed(self) -> Material | None:
        """The current material when it changed since the last call (or on
        the first call); None otherwise."""
        watcher = self.watcher
        assert watcher is not None  # callers check plaintext mode first
        if watcher.due():
            watcher.refresh()
        if watcher.version == self._version:
            return None
        self._version = watcher.version
        return watcher.material


class PermitSigner:
    """Signs grants with the key of this process's current certificate."""

    def __init__(self, security: Security) -> None:
        self._files = _Files(security)
        self._key: object = None
        self._certificate = b""

    def sign(self, grant: s.TransferGrant) -> s.TransferPermit | None:
        """The permit for `grant`; None in plaintext mode."""
        if self._files.watcher is None:
            return None
        material = self._files.changed()
        if material is not None:
            self._key = serialization.load_pem_private_key(material.key, password=None)
            leaf = x509.load_pem_x509_certificate(material.cert)
            self._certificate = leaf.public_bytes(serialization.Encoding.DER)
        data = grant.SerializeToString()
        return s.TransferPermit(
            grant=data, signature=_sign(self._key, data), certificate=self._certificate
        )


class PermitVerifier:
    """Checks permits against the CA bundle of this process's files."""

    def __init__(self, security: Security) -> None:
        self._files = _Files(security)
        self._cas: list[x509.Certificate] = []
        # Certificates already verified against the current CAs: DER -> (the
        # owner it names, its validity window).
        self._known: OrderedDict[bytes, tuple[Caller, datetime.datetime, datetime.datetime]] = (
            OrderedDict()
        )

    @property
    def required(self) -> bool:
        return self._files.watcher is not None

    def signer(self, permit: s.TransferPermit, expected: s.TransferGrant) -> Caller:
        """The owner that signed `permit`, once its certificate, signature and
        grant are checked; PERMISSION_DENIED/TRANSFER_NOT_PERMITTED otherwise.
        The caller still checks that the signer's deployment owns the session."""
        if not permit.grant or not permit.signature or not permit.certificate:
            raise _refused("no permit from the session's current owner came with it")
        for name, value, limit in (
            ("grant", permit.grant, MAX_GRANT_BYTES),
            ("signature", permit.signature, MAX_SIGNATURE_BYTES),
            ("certificate", permit.certificate, MAX_CERTIFICATE_BYTES),
        ):
            if len(value) > limit:
                raise InvalidArgument(
                    Reason.INVALID_FIELD,
                    f"permit.{name} is {len(value)} bytes, over its limit of {limit}",
                )
        try:
            grant = s.TransferGrant.FromString(permit.grant)
        except DecodeError as exc:
            raise _refused("its grant does not decode") from exc
        if grant != expected:
            raise _refused("its grant is for another handoff, fence, checkpoint or deployment")
        caller, certificate = self._certificate(permit.certificate)
        try:
            _verify(certificate.public_key(), permit.signature, permit.grant)
        except (InvalidSignature, TypeError, ValueError) as exc:
            raise _refused("its signature does not match its certificate") from exc
        return caller

    def _certificate(self, der: bytes) -> tuple[Caller, x509.Certificate]:
        self._refresh()
        now = datetime.datetime.now(datetime.UTC)
        try:
            certificate = x509.load_der_x509_certificate(der)
        except ValueError as exc:
            raise _refused("its certificate does not decode") from exc
        known = self._known.get(der)
        if known is not None:
            caller, not_before, not_after = known
            self._known.move_to_end(der)
        else:
            if not any(_issued_by(certificate, ca) for ca in self._cas):
                raise _refused("its certificate is not issued by a trusted CA")
            caller = _owner_named(certificate)
            not_before = certificate.not_valid_before_utc
            not_after = certificate.not_valid_after_utc
            self._known[der] = (caller, not_before, not_after)
            if len(self._known) > _CACHE_SIZE:
                self._known.popitem(last=False)
        if not (not_before - _SKEW <= now <= not_after + _SKEW):
            raise _refused("its certificate is not valid now")
        return caller, certificate

    def _refresh(self) -> None:
        material = self._files.changed() if self._files.watcher is not None else None
        if material is not None:
            self._cas = x509.load_pem_x509_certificates(material.ca)
            self._known.clear()


def _issued_by(certificate: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        certificate.verify_directly_issued_by(ca)
    except (InvalidSignature, TypeError, ValueError):
        return False
    return True


def _owner_named(certificate: x509.Certificate) -> Caller:
    try:
        sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound as exc:
        raise _refused("its certificate names no one") from exc
    uris = [uri.encode() for uri in sans.value.get_values_for_type(x509.UniformResourceIdentifier)]
    try:
        caller = Caller.from_peer(uris)
    except BatonError as exc:
        raise _refused(f"its certificate: {exc.message}") from exc
    if caller.role is not Role.OWNER:
        raise _refused(f"its certificate is of role {caller.describe()}, not an owner")
    return caller


def _sign(key: object, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    raise TypeError(f"cannot sign with a {type(key).__name__}")


def _verify(key: object, signature: bytes, data: bytes) -> None:
    if isinstance(key, ec.EllipticCurvePublicKey):
        key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    elif isinstance(key, rsa.RSAPublicKey):
        key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
    elif isinstance(key, ed25519.Ed25519PublicKey):
        key.verify(signature, data)
    else:
        raise TypeError(f"cannot verify with a {type(key).__name__}")
