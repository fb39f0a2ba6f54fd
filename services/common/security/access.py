"""Which roles may call which RPC: one declared table, deny by default.

The server interceptor (`baton_runtime.common.rpc.interceptor`) looks every call's method
up here and answers PERMISSION_DENIED/ROLE_NOT_ALLOWED when the caller's
certificate role (`baton_runtime.common.security.identity`) is not listed, and
PERMISSION_DENIED/RPC_NOT_ALLOWED when the method has no entry at all. A new
RPC therefore answers nothing until it is added here, and
`tests/test_access.py` fails for any RPC of any Baton service without an
entry.

Beyond the role, servicers scope owners and ingresses to the deployment
their certificate names (e.g. an owner commits, takes over or transfers only
sessions of its own deployment); see the servicers of hooks, anchor and
owner.
"""

from __future__ import annotations

from baton_runtime.common.security.identity import Role

INGRESS = Role.INGRESS
OWNER = Role.OWNER
OPERATOR = Role.OPERATOR
PUBLIC = Role.PUBLIC
# Health and reflection: any holder of a certificate from the deployment's CA
# (on internal servers the TLS handshake already demands one), or anyone on
# the public ingress.
ANY = frozenset(Role)

_HOOKS = "/baton.hooks.v1.HookRegistryService/"
_ANCHOR = "/baton.anchor.v1.AnchorService/"
_OWNER = "/baton.owner.v1.OwnerService/"
_INGRESS = "/baton.ingress.v1.IngressService/"


def _roles(*roles: Role) -> frozenset[Role]:
    return frozenset(roles)


RPC_ROLES: dict[str, frozenset[Role]] = {
    # hooks: the inbox, tokens, ownership, owner instances, transfers
    _HOOKS + "CreateSession": _roles(OWNER),
    _HOOKS + "ClaimHooks": _roles(OWNER),
    _HOOKS + "ResumeHook": _roles(INGRESS, OWNER),
    # (the same appends, multiplexed over one stream per caller and replica)
    _HOOKS + "ResumeHooks": _roles(INGRESS, OWNER),
    _HOOKS + "LookupHook": _roles(INGRESS, OWNER),
    _HOOKS + "DisposeHooks": _roles(OWNER),
    _HOOKS + "StreamInbox": _roles(OWNER),
    _HOOKS + "FollowInboxes": _roles(OWNER),
    _HOOKS + "RegisterInstance": _roles(OWNER),
    _HOOKS + "KeepAliveInstance": _roles(OWNER),
    _HOOKS + "DeregisterInstance": _roles(OWNER),
    _HOOKS + "SetInstanceDrain": _roles(OWNER),
    # (an ingress checks whether an orphaned session's deployment is live)
    _HOOKS + "ListInstances": _roles(INGRESS, OWNER, OPERATOR),
    _HOOKS + "WatchInstances": _roles(OWNER),
    _HOOKS + "ListInstanceSessions": _roles(OWNER, OPERATOR),
    _HOOKS + "TakeOverSession": _roles(OWNER),
    _HOOKS + "SetParked": _roles(OWNER),
    _HOOKS + "WatchBells": _roles(OWNER),
    _HOOKS + "Transfer": _roles(OWNER),
    _HOOKS + "GetTransfer": _roles(OWNER, OPERATOR),
    _HOOKS + "GetOwner": _roles(OWNER, OPERATOR),
    # introspection reads (an ingress names its caller's channel)
    _HOOKS + "DescribeSession": _roles(INGRESS, OPERATOR),
    _HOOKS + "ListChannelSessions": _roles(INGRESS, OPERATOR),
    # operator views of the owner fleets
    _HOOKS + "ListDeployments": _roles(OPERATOR),
    _HOOKS + "DescribeDeployment": _roles(OPERATOR),
    # anchor: the journal
    _ANCHOR + "CommitStep": _roles(OWNER),
    # (the same commits, multiplexed over one stream per owner and replica)
    _ANCHOR + "CommitSteps": _roles(OWNER),
    _ANCHOR + "GetSnapshot": _roles(INGRESS, OWNER, OPERATOR),
    _ANCHOR + "ReadEvents": _roles(INGRESS, OWNER, OPERATOR),
    _ANCHOR + "FollowEvents": _roles(INGRESS, OWNER, OPERATOR),
    # (any deployment's owner: a handoff target loads the old owner's checkpoint)
    _ANCHOR + "LoadSession": _roles(OWNER, OPERATOR),
    _ANCHOR + "RetireHistory": _roles(OWNER),
    # (live items of running steps, in memory: docs/design.md "Live items")
    _ANCHOR + "PublishLive": _roles(OWNER),
    # owner: session starts (from its own deployment's ingress; child
    # sessions from its own deployment's owners) and handoffs
    _OWNER + "StartSession": _roles(INGRESS, OWNER),
    _OWNER + "AcceptHandoff": _roles(OWNER),
    # an operator retires a deployment; an ingress has its own deployment's
    # owner adopt sessions whose deployment is gone
    _OWNER + "DrainSessions": _roles(OPERATOR),
    _OWNER + "UndrainSessions": _roles(OPERATOR),
    # an operator runs a stalled session again (docs/failures.md)
    _OWNER + "ResumeSession": _roles(OPERATOR),
    _OWNER + "AdoptSession": _roles(INGRESS),
    # ingress: the public API, authenticated by channel API keys
    _INGRESS + "CreateSession": _roles(PUBLIC),
    _INGRESS + "SendMessage": _roles(PUBLIC),
    _INGRESS + "StreamEvents": _roles(PUBLIC),
    _INGRESS + "SendControl": _roles(PUBLIC),
    _INGRESS + "GetSession": _roles(PUBLIC),
    _INGRESS + "ListSessions": _roles(PUBLIC),
    # every server
    "/grpc.health.v1.Health/Check": ANY,
    "/grpc.health.v1.Health/Watch": ANY,
    "/grpc.health.v1.Health/List": ANY,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": ANY,
}

# The bidirectional streams of the table: calls multiplexed between peers
# (services/common/streams/multiplex.py), and follows (services/common/streams/feeds.py).
# Every other client-streaming method is refused, entry or not.
MULTIPLEXED = frozenset(
    {
        _ANCHOR + "CommitSteps",
        _ANCHOR + "FollowEvents",
        _ANCHOR + "PublishLive",
        _HOOKS + "ResumeHooks",
        _HOOKS + "FollowInboxes",
    }
)


def allowed_roles(method: str) -> frozenset[Role] | None:
    """The roles that may call `method` (a full `/package.Service/Method`
    path); None when the table has no entry (then nobody may)."""
    return RPC_ROLES.get(method)
