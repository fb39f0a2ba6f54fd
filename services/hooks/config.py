"""hooks configuration: flags, then env, then defaults."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from baton_runtime.common.config import Setting, StoreServiceConfig, as_float
from baton_runtime.hooks.expiry import DEFAULT_WINDOW_SECONDS
from baton_runtime.hooks.unanswered import SWEEP_SECONDS


@dataclass(frozen=True)
class HooksConfig(StoreServiceConfig):
    # How long a delivery id (and a handoff record) is remembered: a repeat
    # inside it answers the first receipt (services/hooks/expiry.py).
    dedupe_window_seconds: float = DEFAULT_WINDOW_SECONDS
    # Seconds between sweeps of the inboxes for each deployment's oldest
    # unanswered message (services/hooks/unanswered.py; only while metrics
    # are served).
    unanswered_sweep_seconds: float = SWEEP_SECONDS

    @classmethod
    def load(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> HooksConfig:
        listen = Setting(
            "--listen", "BATON_HOOKS_LISTEN", "host:port to serve on", "127.0.0.1:50052"
        )
        window = Setting(
            "--dedupe-window",
            "BATON_DEDUPE_WINDOW",
            "seconds a delivery id (and a handoff record) is remembered: a repeat inside "
            "the window answers the first receipt, after it the id is a new command",
            str(int(DEFAULT_WINDOW_SECONDS)),
        )
        sweep = Setting(
            "--unanswered-sweep",
            "BATON_UNANSWERED_SWEEP",
            "seconds between sweeps of the inboxes for baton_oldest_unanswered_seconds "
            "(each reads one key per session; while metrics are served)",
            str(int(SWEEP_SECONDS)),
        )
        shared, values = cls.read("baton_runtime.hooks", listen, (window, sweep), argv, environ)
        return cls(
            **shared,
            dedupe_window_seconds=as_float(values, "dedupe_window", minimum=1.0),
            unanswered_sweep_seconds=as_float(values, "unanswered_sweep", minimum=1.0),
        )
