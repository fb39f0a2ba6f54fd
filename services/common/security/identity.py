"""Who is calling: the role and deployment a client certificate names.

Every Baton certificate carries exactly one URI SAN, a SPIFFE id in the
`baton` trust domain:

    spiffe://baton/hooks                 spiffe://baton/owner/{deployment_id}
    spiffe://baton/anchor                spiffe://baton/ingress/{deployment_id}
    spiffe://baton/operator

Owners and ingresses name their exact deployment; the shared services and
operators name none. The server's interceptor reads the id from the verified
peer certificate (`Caller.from_peer`), binds it for the call (`current`), and
checks the per-RPC table in `baton_runtime.common.security.access`. Servicers then scope
what an owner may touch to its own deployment (`Caller.require_deployment`).

In explicit plaintext mode (local development on loopback) there is no
certificate: the caller is `Caller.UNVERIFIED`, which every role check and
scope check lets through. Nothing else ever trusts an absent identity.
"""

from __future__ import annotations

import contextvars
import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from baton_runtime.common.errors import PermissionDenied, Reason, Unauthenticated
from baton_runtime.common.ids import validate_deployment_id

TRUST_DOMAIN = "baton"
_SPIFFE_PREFIX = f"spiffe://{TRUST_DOMAIN}/"
_DEPLOYMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Role(enum.Enum):
    """What a certificate holder is. `PUBLIC` is never in a certificate: it
    marks RPCs open to any TLS client (ingress's API, authenticated by key)."""

    INGRESS = "ingress"
    OWNER = "owner"
    HOOKS = "hooks"
    ANCHOR = "anchor"
    OPERATOR = "operator"
    PUBLIC = "public"


# Roles whose certificates name a deployment id.
DEPLOYMENT_ROLES = frozenset({Role.INGRESS, Role.OWNER})
CERTIFICATE_ROLES = frozenset(Role) - {Role.PUBLIC}


def spiffe_id(role: Role, deployment_id: str = "") -> str:
    """The URI SAN of a certificate for `role` (and deployment)."""
    if role not in CERTIFICATE_ROLES:
        raise ValueError(f"no certificate is issued for role {role.value}")
    if role in DEPLOYMENT_ROLES:
        if not _DEPLOYMENT_RE.match(deployment_id) or deployment_id.lower() == "latest":
            raise ValueError(f"role {role.value} needs an exact deployment id")
        return f"{_SPIFFE_PREFIX}{role.value}/{deployment_id}"
    if deployment_id:
        raise ValueError(f"role {role.value} names no deployment")
    return f"{_SPIFFE_PREFIX}{role.value}"


@dataclass(frozen=True)
class Caller:
    """The verified identity of the peer of one call."""

    role: Role | None
    deployment_id: str = ""
    verified: bool = True

    UNVERIFIED: ClassVar[Caller]

    @classmethod
    def parse(cls, uri: str) -> Caller:
        """A SPIFFE id -> Caller; Unauthenticated if it is not a Baton one."""
        if not uri.startswith(_SPIFFE_PREFIX):
            raise Unauthenticated(
                Reason.NO_CLIENT_IDENTITY, "the client certificate names no Baton identity"
            )
        role_name, _, deployment_id = uri[len(_SPIFFE_PREFIX) :].partition("/")
        try:
            role = Role(role_name)
        except ValueError:
            role = None
        if role is None or role not in CERTIFICATE_ROLES:
            raise Unauthenticated(
                Reason.NO_CLIENT_IDENTITY, "the client certificate names no Baton role"
            )
        if (role in DEPLOYMENT_ROLES) != bool(deployment_id) or (
            deployment_id and not _DEPLOYMENT_RE.match(deployment_id)
        ):
            raise Unauthenticated(
                Reason.NO_CLIENT_IDENTITY,
                f"the client certificate's {role.value} identity has a malformed deployment",
            )
        return cls(role=role, deployment_id=deployment_id)

    @classmethod
    def from_peer(cls, identities: Iterable[bytes] | None) -> Caller:
        """The caller named by the peer certificate's SANs (gRPC's
        `peer_identities()`): exactly one `spiffe://baton/...` URI."""
        ids = [i for i in identities or () if i.startswith(b"spiffe://")]
        if len(ids) != 1:
            raise Unauthenticated(
                Reason.NO_CLIENT_IDENTITY,
                "a client certificate with exactly one spiffe://baton/ URI SAN is required",
            )
        return _parse_cached(ids[0])

    def has(self, allowed: frozenset[Role]) -> bool:
        return not self.verified or (self.role is not None and self.role in allowed)

    def require_deployment(self, deployment_id: str, what: str) -> None:
        """An owner or ingress may act only for its own deployment. (A
        malformed id is refused as such first: INVALID_ARGUMENT.)"""
        if not self.verified or self.role not in DEPLOYMENT_ROLES:
            return
        validate_deployment_id(deployment_id)
        if deployment_id != self.deployment_id:
            raise deployment_not_allowed(self.deployment_id, what)

    @property
    def internal(self) -> bool:
        """Not a tenant's agent: an owner, a shared service or an operator
        (or anyone in explicit plaintext mode)."""
        return not self.verified or self.role in (
            Role.OWNER,
            Role.HOOKS,
            Role.ANCHOR,
            Role.OPERATOR,
        )

    def describe(self) -> str:
        if not self.verified:
            return "unverified (plaintext)"
        assert self.role is not None
        return f"{self.role.value}/{self.deployment_id}" if self.deployment_id else self.role.value


Caller.UNVERIFIED = Caller(role=None, verified=False)

_PARSED: dict[bytes, Caller] = {}


def _parse_cached(raw: bytes) -> Caller:
    caller = _PARSED.get(raw)
    if caller is None:
        caller = Caller.parse(raw.decode("utf-8", "replace"))
        if len(_PARSED) > 10_000:
            _PARSED.clear()
        _PARSED[raw] = caller
    return caller


_CURRENT: contextvars.ContextVar[Caller] = contextvars.ContextVar("baton_caller")


def bind(caller: Caller) -> None:
    _CURRENT.set(caller)


def current() -> Caller:
    """The caller of the RPC being served. Outside any RPC (in-process calls
    of domain code, tests) nobody is bound: that is a bug, not a trust grant."""
    try:
        return _CURRENT.get()
    except LookupError:
        raise PermissionDenied(Reason.ROLE_NOT_ALLOWED, "no caller identity is bound") from None


def deployment_not_allowed(certificate_deployment: str, what: str) -> PermissionDenied:
    """The refusal of a caller whose certificate names `certificate_deployment`
    acting on `what`, which belongs to another deployment."""
    return PermissionDenied(
        Reason.DEPLOYMENT_NOT_ALLOWED,
        f"the caller's certificate names deployment {certificate_deployment}; "
        f"{what} belongs to another deployment",
    )
