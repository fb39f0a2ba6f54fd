"""The edge's rules: who is calling, what they address, what gets stamped."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as ingress_pb
from baton_runtime._proto.baton.owner.v1 import owner_pb2 as owner_pb
from baton_runtime._proto.baton.session.v1 import session_pb2 as s
from baton_runtime.common import ids
from baton_runtime.common.bounds import check_seq, check_session_settings
from baton_runtime.common.clients.anchor import AnchorClient
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.clients.owner import OwnerClient
from baton_runtime.common.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Reason,
    Unauthenticated,
)
from baton_runtime.common.observability import metrics
from baton_runtime.ingress.api_keys import ApiKeys
from baton_runtime.ingress.orphans import OrphanWatch
from baton_runtime.ingress.rates import ChannelBudget, ChannelLimits

MAX_LABELS = 32
MAX_LABEL_BYTES = 256
MAX_ALIASES = ids.MAX_HOOKS_PER_SESSION
MAX_INPUT_RESPONSES = 64
# baton_sends_total's children, looked up once (a label lookup per send
# showed in the receipt's profile).
_ACCEPTED = metrics.SENDS.labels("accepted")
_DUPLICATE = metrics.SENDS.labels("duplicate")
_REFUSED = metrics.SENDS.labels("refused")


def session_not_found(session_id: str) -> NotFound:
    """The one answer for a session id the caller's channel cannot address,
    whether it does not exist or belongs to another channel (Google AIP-211:
    no existence leak; see docs/security.md "Existence")."""
    return NotFound(Reason.SESSION_NOT_FOUND, f"session {session_id} not found")


class Edge:
    """Authentication, addressing and stamping for channel gateways."""

    def __init__(
        self,
        deployment_id: str,
        api_keys: ApiKeys,
        hooks: HooksClient,
        anchor: AnchorClient,
        owner: OwnerClient,
        max_message_bytes: int,
        orphans: OrphanWatch | None = None,
        limits: ChannelLimits | None = None,
    ) -> None:
        self.deployment_id = ids.validate_deployment_id(deployment_id)
        self.api_keys = api_keys
        self.budget = ChannelBudget(limits or ChannelLimits())
        self._hooks = hooks
        self._anchor = anchor
        self._owner = owner
        self._max_message_bytes = max_message_bytes
        self._orphans = orphans

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The channel whose API key is in `authorization: Bearer <key>`."""
        header = ""
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str):
                header = value
        if not header:
            raise Unauthenticated(
                Reason.MISSING_API_KEY, "send the channel API key as 'authorization: Bearer <key>'"
            )
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated(Reason.INVALID_API_KEY, "authorization must be 'Bearer <key>'")
        channel = self.api_keys.channel_of(key.strip())
        if channel is None:
            raise Unauthenticated(Reason.INVALID_API_KEY, "unknown API key")
        return channel

    def alias_token(self, channel: str, alias: str) -> str:
        """A raw alias is namespaced by the caller's channel; a qualified one
        must name the caller's own channel."""
        if ":" in alias:
            namespace, raw = ids.split_token(alias)
            if namespace != channel:
                raise PermissionDenied(
                    Reason.CROSS_TENANT,
                    f"alias {alias!r} belongs to channel {namespace!r}, not {channel!r}",
                )
            return alias
        return ids.alias_token(channel, ids.validate_raw_token(alias))

    def target_token(self, channel: str, session_id: str, alias: str) -> str:
        if session_id:
            return ids.inbox_token(ids.validate_session_id(session_id))
        if alias:
            return self.alias_token(channel, alias)
        raise InvalidArgument(Reason.MISSING_FIELD, "name the session by session_id or alias")

    async def create_session(
        self,
        channel: str,
        request_id: str,
        aliases: list[str],
        *,
        timeout_seconds: int = 0,
        token_budget: int = 0,
    ) -> tuple[str, bool]:
        if request_id:
            ids.validate_id(request_id, "request_id")
            session_id = ids.session_id_for_request(channel, request_id)
        else:
            session_id = ids.new_session_id()
        check_session_settings(timeout_seconds, token_budget)
        if len(aliases) > MAX_ALIASES:
            raise InvalidArgument(
                Reason.TOO_MANY_HOOKS,
                f"a session may hold at most {ids.MAX_HOOKS_PER_SESSION} addresses",
            )
        tokens = list(dict.fromkeys(self.alias_token(channel, a) for a in aliases))
        if len(tokens) + 1 > ids.MAX_HOOKS_PER_SESSION:
            raise InvalidArgument(
                Reason.TOO_MANY_HOOKS,
                f"a session may hold at most {ids.MAX_HOOKS_PER_SESSION} addresses",
            )
        self.budget.admit_create(channel)
        response = await self._owner.start_session(
            owner_pb.StartSessionRequest(
                session_id=session_id,
                deployment_id=self.deployment_id,
                channel=channel,
                aliases=tokens,
                timeout_seconds=timeout_seconds,
                token_budget=token_budget,
            )
        )
        return response.session_id, response.created

    def _stamp(
        self, channel: str, delivery_id: str, caller: str, labels: Mapping[str, str]
    ) -> s.DeliveryMetadata:
        """Delivery metadata: the caller's ids checked, this deployment stamped
        (whatever the client sent), a delivery id generated when absent."""
        if delivery_id:
            ids.validate_id(delivery_id, "delivery_id")
        else:
            delivery_id = ids.new_delivery_id()
        if caller:
            ids.validate_id(caller, "caller")
        return s.DeliveryMetadata(
            delivery_id=delivery_id,
            channel=channel,
            accepted_deployment_id=self.deployment_id,
            caller=caller,
            labels=labels,
        )

    def build_send(
        self,
        channel: str,
        text: str,
        input_responses: Iterable[s.InputResponse],
        turn_policy: s.TurnPolicy.ValueType,
        delivery_id: str,
        caller: str,
        labels: Mapping[str, str],
    ) -> s.Command:
        """A send command, stamped with this ingress's deployment id."""
        responses = list(input_responses)
        if len(responses) > MAX_INPUT_RESPONSES:
            raise InvalidArgument(
                Reason.INVALID_FIELD, f"at most {MAX_INPUT_RESPONSES} input responses"
            )
        for response in responses:
            if response.request_id:
                ids.validate_id(response.request_id, "input_responses.request_id")
        if turn_policy not in (
            s.TURN_POLICY_UNSPECIFIED,
            s.TURN_POLICY_STEER,
            s.TURN_POLICY_QUEUE,
        ):
            raise InvalidArgument(Reason.INVALID_FIELD, f"unknown turn_policy {int(turn_policy)}")
        if not text.strip() and not responses:
            raise InvalidArgument(Reason.EMPTY_MESSAGE, "the message text is empty")
        size = len(text.encode()) + sum(len(r.text.encode()) for r in responses)
        if size > self._max_message_bytes:
            raise InvalidArgument(
                Reason.MESSAGE_TOO_LARGE,
                f"the message is {size} bytes; the limit is {self._max_message_bytes}",
            )
        if len(labels) > MAX_LABELS or any(
            len(k) + len(v) > MAX_LABEL_BYTES for k, v in labels.items()
        ):
            raise InvalidArgument(
                Reason.INVALID_FIELD, f"at most {MAX_LABELS} labels of {MAX_LABEL_BYTES} bytes"
            )
        return s.Command(
            delivery=self._stamp(channel, delivery_id, caller, labels),
            send=s.SendCommand(
                text=text,
                input_responses=responses,
                turn_policy=turn_policy or s.TURN_POLICY_STEER,
            ),
        )

    def build_control(
        self,
        channel: str,
        kind: int,
        delivery_id: str,
        caller: str,
        reason: str,
        attempt_id: str,
        granted: bool,
    ) -> s.Command:
        """A control command (cancel, reset, clear, compact, sign-in callback)."""
        if len(reason) > 1024:
            raise InvalidArgument(Reason.INVALID_FIELD, "reason is longer than 1024 characters")
        command = s.Command(delivery=self._stamp(channel, delivery_id, caller, {}))
        if kind == ingress_pb.CONTROL_KIND_CANCEL:
            command.cancel.reason = reason
        elif kind == ingress_pb.CONTROL_KIND_RESET:
            command.reset.reason = reason
        elif kind == ingress_pb.CONTROL_KIND_CLEAR:
            command.clear.SetInParent()
        elif kind == ingress_pb.CONTROL_KIND_COMPACT:
            command.compact.SetInParent()
        elif kind == ingress_pb.CONTROL_KIND_AUTHORIZATION_CALLBACK:
            ids.validate_id(attempt_id, "attempt_id")
            command.authorization_callback.attempt_id = attempt_id
            command.authorization_callback.granted = granted
        else:
            raise InvalidArgument(Reason.UNKNOWN_COMMAND, f"unknown control kind {kind}")
        return command

    async def send(self, channel: str, token: str, command: s.Command) -> s.Receipt:
        """Deliver (within the channel's send rate); a session id the channel
        cannot address answers as if it did not exist. Counted in
        baton_sends_total: accepted, duplicate or refused (a limit, or hooks)."""
        try:
            self.budget.admit_send(channel)
            receipt = await self._hooks.append(token, command, channel)
        except Exception:
            _REFUSED.inc()
            raise
        (_DUPLICATE if receipt.duplicate else _ACCEPTED).inc()
        if self._orphans is not None:
            self._orphans.accepted(receipt)
        return receipt

    async def addressed_session(self, channel: str, session_id: str, alias: str) -> str:
        """The session id a request names: validated as given, or resolved
        from an alias of the caller's channel (tenancy of a session id is
        checked by whoever reads the session)."""
        if alias:
            return (await self._hooks.lookup(self.alias_token(channel, alias), channel)).session_id
        if not session_id:
            raise InvalidArgument(Reason.MISSING_FIELD, "name the session by session_id or alias")
        return ids.validate_session_id(session_id)

    async def resolve_session(self, channel: str, session_id: str, alias: str) -> str:
        """The session a reader addresses, checked against the caller's tenancy."""
        if alias:
            return (await self._hooks.lookup(self.alias_token(channel, alias), channel)).session_id
        if not session_id:
            raise InvalidArgument(Reason.MISSING_FIELD, "name the session by session_id or alias")
        ids.validate_session_id(session_id)
        # The snapshot names the tenant, and outlives the tokens of a finalized session.
        try:
            snapshot = await self._anchor.snapshot(session_id)
        except NotFound:
            # No commit yet (a child session commits session.started with its
            # first turn): its inbox token names the tenant (another
            # channel's session is as unknown as a missing one, AIP-211).
            try:
                await self._hooks.lookup(ids.inbox_token(session_id), channel)
            except NotFound:
                raise session_not_found(session_id) from None
            return session_id
        if snapshot.channel != channel:
            raise session_not_found(session_id)
        return session_id

    async def stream(
        self, channel: str, session_id: str, start_seq: int, follow: bool, live: bool = False
    ) -> AsyncIterator[Sequence[s.Event] | s.LiveBatch]:
        """The session's events (with `follow` and `live`, and its live
        items: docs/design.md "Live items"); a following read holds one of
        the channel's follow-stream slots while it is open."""
        check_seq(start_seq, "start_seq")
        if not follow:
            async for page in self._anchor.read_events(session_id, start_seq, False):
                yield page
            return
        with self.budget.follow_stream(channel):
            if live:
                async for item in self._anchor.follow_events_live(session_id, start_seq):
                    yield item
                return
            async for page in self._anchor.read_events(session_id, start_seq, True):
                yield page
