"""What one `baton up` is asked for (`LaunchSettings`), its defaults, and
the one error its startup raises (`LaunchError`)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_DEPLOYMENT_ID = "dep-1"
# The agents `baton up` runs when told none (no --agent, no BATON_AGENT):
# the fixture on the first deployment, its version 2 on every other one, so
# that a session moving between them visibly moves to new code.
FIXTURE_AGENT = "baton_runtime.owner.agents.fixture:build_agent"
FIXTURE_AGENT_V2 = "baton_runtime.owner.agents.fixture:build_agent_v2"
DEFAULT_PORT_BASE = 50051
DEFAULT_ETCD_PORT = 23790
DEMO_CHANNEL = "demo"
# Well known, so loopback-only: `baton up` grants it unless given a key file.
DEMO_API_KEY = "demo-key-0001-loopback-only"
# The key prefix of every `baton up`'s data, which its etcd users are limited to.
ETCD_PREFIX = "/baton/"


class LaunchError(Exception):
    """Startup failed; the message says what and where to look."""


@dataclass(frozen=True)
class LaunchSettings:
    """The flags of `baton up`, checked (services/cli/commands/up_command.py)."""

    # One owner + one ingress per id, in this order; the first is where the
    # demo creates its session.
    deployment_ids: tuple[str, ...] = (DEFAULT_DEPLOYMENT_ID,)
    # The agent (`module:factory`) each deployment's owners load, by
    # deployment id; a deployment not named here gets BATON_AGENT from the
    # environment (or the owner's default).
    agents: tuple[tuple[str, str], ...] = ()
    port_base: int = DEFAULT_PORT_BASE
    etcd_port: int = DEFAULT_ETCD_PORT
    # The ingress's API key file; "" grants the demo key (written to the run dir).
    api_key_file: str = ""
    # No TLS, no etcd auth (loopback only).
    plaintext: bool = False
    demo: bool = False
    run_dir: str | None = None
    log_level: str = "info"
    startup_timeout: float = 60.0
    stop_timeout: float = 10.0
    # Processes per service (hooks, anchor, and each deployment's owner and
    # ingress), and etcd members forming one cluster.
    replicas: int = 1
    etcd_members: int = 1
    # The etcd executable ("" = the first safe one found: `find_etcd`), and
    # whether a known-bad release may run (services/common/etcd/releases.py).
    etcd_binary: str = ""
    accept_etcd_risk: bool = False
    # A live session's stream retention, passed to anchor
    # (--stream-retention-events, --stream-retention); None: anchor's default.
    stream_retention_events: int | None = None
    stream_retention: float | None = None
    # hooks' --dedupe-window (seconds; None: hooks' default, a day).
    dedupe_window: float | None = None

    def __post_init__(self) -> None:
        if not self.deployment_ids:
            raise ValueError("at least one deployment id is required")
        if len(set(self.deployment_ids)) != len(self.deployment_ids):
            raise ValueError(f"deployment ids repeat: {', '.join(self.deployment_ids)}")
        unknown = [dep for dep, _ in self.agents if dep not in self.deployment_ids]
        if unknown:
            raise ValueError(f"agents for deployments not run: {', '.join(unknown)}")

    def agent_of(self, deployment_id: str) -> str:
        """The agent spec `deployment_id`'s owners load ("" = their environment's)."""
        return dict(self.agents).get(deployment_id, "")
