"""The CLI's connection profile: where a running `baton up` can be reached.

`baton up` writes one when everything is SERVING (the first deployment's
ingress, hooks and anchor, the CA of its run dir and the paths of its
operator certificate, or plaintext) and removes it when it stops, if it is
still its own. The commands that talk to a running Baton (`baton sessions
...`, `baton deployments ...`, `baton handoffs ...`) read it as their
defaults, so against `baton up` they need no flags. Precedence, highest
first: flags, environment variables (BATON_INGRESS_ADDR, BATON_HOOKS_ADDR,
BATON_ANCHOR_ADDR, BATON_TLS_CA, BATON_TLS_CERT, BATON_TLS_KEY,
BATON_PLAINTEXT, BATON_API_KEY), the profile, built-in defaults
(127.0.0.1:50051-50053, the loopback demo key).

The profile holds no secret: an API key comes from the environment only
(the demo key is public, and only for loopback); the operator certificate
is named by its files' paths.

Where: $BATON_PROFILE, else $XDG_CONFIG_HOME/baton/profile.json (default
~/.config/baton/profile.json).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


class ProfileError(Exception):
    """The profile file exists but cannot be read (the message says why)."""


@dataclass(frozen=True)
class Profile:
    """Connection settings of one running Baton."""

    ingress: str = ""
    ca_cert: str = ""
    plaintext: bool = False
    hooks: str = ""
    anchor: str = ""
    # The operator certificate and key (paths) for hooks, anchor and owners.
    operator_cert: str = ""
    operator_key: str = ""
    # The run dir of the `baton up` that wrote it (to remove only its own).
    run_dir: str = ""


def default_path(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("BATON_PROFILE"):
        return Path(env["BATON_PROFILE"])
    config = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "baton" / "profile.json"


def read(path: Path) -> Profile | None:
    """The profile at `path`; None when there is none."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ProfileError(f"cannot read the profile {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"the profile {path} is not a JSON object")
    return Profile(
        ingress=str(data.get("ingress", "")),
        ca_cert=str(data.get("ca_cert", "")),
        plaintext=bool(data.get("plaintext", False)),
        hooks=str(data.get("hooks", "")),
        anchor=str(data.get("anchor", "")),
        operator_cert=str(data.get("operator_cert", "")),
        operator_key=str(data.get("operator_key", "")),
        run_dir=str(data.get("run_dir", "")),
    )


def write(path: Path, profile: Profile) -> None:
    """Write atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(asdict(profile), indent=2) + "\n")
    partial.replace(path)


def remove_if_ours(path: Path, run_dir: str) -> None:
    """Remove the profile if the `baton up` of `run_dir` wrote it (another
    one started since owns it now)."""
    try:
        current = read(path)
    except ProfileError:
        return
    if current is not None and current.run_dir == run_dir:
        path.unlink(missing_ok=True)
