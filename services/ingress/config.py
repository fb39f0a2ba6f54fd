"""ingress configuration. Refuses to start without an exact deployment id or
without an API key file (keys never come from argv or the environment)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from baton_runtime.common.config import (
    ADDRESSES_HELP,
    COMMON_SETTINGS,
    Capacity,
    ConfigError,
    Setting,
    as_addresses,
    as_float,
    as_int,
    as_listen,
    as_switch,
    read_settings,
    security_from_values,
)
from baton_runtime.common.errors import BatonError
from baton_runtime.common.ids import validate_deployment_id
from baton_runtime.common.limits import MAX_MESSAGE_TEXT_BYTES
from baton_runtime.common.security.tls import Security
from baton_runtime.ingress.api_keys import ApiKeys
from baton_runtime.ingress.rates import ChannelLimits

# ingress's own settings; COMMON_SETTINGS follow them in --help.
_SETTINGS = (
    Setting("--listen", "BATON_INGRESS_LISTEN", "host:port to serve on", "127.0.0.1:50051"),
    Setting("--deployment-id", "BATON_DEPLOYMENT_ID", "exact deployment id of this build"),
    Setting(
        "--api-keys-file",
        "BATON_API_KEYS_FILE",
        "file of channel=sha256:<hex> (or channel=<key>) lines; re-read on SIGHUP",
    ),
    Setting("--hooks", "BATON_HOOKS_ADDR", f"hooks: {ADDRESSES_HELP}", "127.0.0.1:50052"),
    Setting("--anchor", "BATON_ANCHOR_ADDR", f"anchor: {ADDRESSES_HELP}", "127.0.0.1:50053"),
    Setting(
        "--owner",
        "BATON_OWNER_ADDR",
        f"owners of this deployment: {ADDRESSES_HELP}",
        "127.0.0.1:50054",
    ),
    Setting(
        "--max-message-bytes",
        "BATON_MAX_MESSAGE_BYTES",
        f"largest message text (at most {MAX_MESSAGE_TEXT_BYTES}: hooks takes commands"
        " of up to 256 KiB)",
        "32768",
    ),
    Setting(
        "--max-follow-streams",
        "BATON_MAX_FOLLOW_STREAMS",
        "open following StreamEvents calls per channel (0 = no limit)",
        str(ChannelLimits.follow_streams),
    ),
    Setting(
        "--max-sends-per-second",
        "BATON_MAX_SENDS_PER_SECOND",
        "SendMessage + SendControl calls per second per channel (0 = no limit)",
        str(ChannelLimits.sends_per_second),
    ),
    Setting(
        "--max-sessions-per-minute",
        "BATON_MAX_SESSIONS_PER_MINUTE",
        "CreateSession calls per minute per channel (0 = no limit)",
        str(ChannelLimits.sessions_per_minute),
    ),
    Setting(
        "--resume-stream",
        "BATON_INGRESS_RESUME_STREAM",
        "append sends over one multiplexed ResumeHooks stream per hooks replica (1), "
        "or with one unary ResumeHook call each (0)",
        "1",
    ),
    Setting(
        "--event-feed",
        "BATON_INGRESS_EVENT_FEED",
        "read every followed session's events over one multiplexed FollowEvents stream (1), "
        "or with one ReadEvents call per reader (0)",
        "1",
    ),
)


@dataclass(frozen=True)
class IngressConfig:
    listen: str
    deployment_id: str
    # Channel API keys (hashes), reloaded from their file on SIGHUP.
    api_keys: ApiKeys
    hooks: str
    anchor: str
    owner: str
    # Serves TLS to gateways (no client certificate asked) and calls hooks,
    # anchor and owner with this identity; or plaintext.
    tls: Security
    max_message_bytes: int = 32 * 1024
    log_level: str = "info"
    grace: float = 5.0
    limits: ChannelLimits = ChannelLimits()
    # Appends ride a multiplexed ResumeHooks stream (services/common/streams/multiplex.py);
    # False: one unary ResumeHook call each.
    resume_stream: bool = True
    # Event reads ride one FollowEvents stream (services/common/streams/feeds.py);
    # False: one ReadEvents call each.
    event_feed: bool = True
    capacity: Capacity = Capacity()
    # A plaintext listener serving only health (probes without TLS); empty: none.
    health_listen: str = ""
    # A plaintext HTTP listener serving Prometheus metrics; empty: none.
    metrics_listen: str = ""

    @classmethod
    def load(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> IngressConfig:
        values = read_settings(
            "baton_runtime.ingress", (*_SETTINGS, *COMMON_SETTINGS), argv, environ
        )
        try:
            deployment_id = validate_deployment_id(values["deployment_id"])
        except BatonError as exc:
            raise ConfigError(f"baton_runtime.ingress: {exc.message}") from exc
        return cls(
            listen=values["listen"],
            deployment_id=deployment_id,
            api_keys=ApiKeys(values["api_keys_file"]),
            hooks=as_addresses(values, "hooks"),
            anchor=as_addresses(values, "anchor"),
            owner=as_addresses(values, "owner"),
            tls=security_from_values(values),
            max_message_bytes=as_int(
                values, "max_message_bytes", minimum=1, maximum=MAX_MESSAGE_TEXT_BYTES
            ),
            log_level=values["log_level"],
            grace=as_float(values, "grace"),
            limits=_channel_limits(values),
            resume_stream=as_switch(values, "resume_stream"),
            event_feed=as_switch(values, "event_feed"),
            capacity=Capacity.from_values(values),
            health_listen=values["health_listen"],
            metrics_listen=as_listen(values, "metrics_listen"),
        )


def _channel_limits(values: Mapping[str, str]) -> ChannelLimits:
    return ChannelLimits(
        follow_streams=as_int(values, "max_follow_streams"),
        sends_per_second=as_float(values, "max_sends_per_second"),
        sessions_per_minute=as_float(values, "max_sessions_per_minute"),
    )
