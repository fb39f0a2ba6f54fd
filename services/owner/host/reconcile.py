"""One owner instance's reconciliation (docs/design.md §5, issue 16): the
safety net under the watches, one round every few seconds
(`FleetMembership` runs the rounds).

A round lists this instance's ownership index with its bells, no owner
record read (ListInstanceSessions `index_only`: two etcd reads a page of a
thousand sessions), and repairs what a lost watch event or a bug in the host
left:

- A session indexed here that the host holds in no state (running, loading,
  parked, stalled) at two rounds in a row, with the same fence, has no run
  anywhere (the index names its owner): this instance takes it over from
  itself (epoch + 1) and runs it. Two sightings, because a session being
  created or transferred here is indexed a moment before the host holds it.
  The index alone may be stale (an entry outlives a session that moved on
  until a takeover attempt drops it), so the owner records are read, in a
  full listing, only then, and only a session whose record still names the
  fence seen twice is taken over.
- A session the host holds parked while its bell rang, at two rounds with
  the same fence, never got its bell (a wake deletes the bell, so two
  sightings one interval apart are no race with a wake in flight): woken.

So an idle instance's rounds cost its index and its bells, not a read of
every owner record. Each repair is logged and counted in
`baton_reconciled_sessions_total{how}`.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from baton_runtime.common.clients.answers import OwnedSession
from baton_runtime.common.clients.hooks import HooksClient
from baton_runtime.common.observability import metrics
from baton_runtime.owner.host.host import OwnerHost
from baton_runtime.owner.host.sweep import ParkedSweep, claim_all


class Reconciler:
    """The rounds' memory (what was seen at the last round) and one round."""

    def __init__(
        self,
        host: OwnerHost,
        hooks: HooksClient,
        parked: ParkedSweep,
        log: structlog.BoundLogger,
    ) -> None:
        self.host = host
        self.hooks = hooks
        self.parked = parked
        self._log = log
        # Sessions indexed here that the host did not hold at the last
        # round: session id -> fence value seen then.
        self._unheld: dict[str, bytes] = {}
        # Sessions the host held parked whose bell had rung at the last
        # round: session id -> fence value then.
        self._unwoken: dict[str, bytes] = {}

    async def round(self) -> None:
        """Read the index and the bells; wake and take over what was seen
        unrepaired twice (BatonError when a listing fails)."""
        host = self.host
        indexed = await self.hooks.list_instance_sessions(
            host.deployment_id, host.instance_id, index_only=True
        )
        for sid in self._unwoken_parked(indexed):
            if host.wake_parked(sid):
                metrics.RECONCILED.labels("woken").inc()
                self._log.warning(
                    "a parked session had input waiting and no bell reached it: woken",
                    session_id=sid,
                )
        unheld = self._unheld_twice(indexed)
        if unheld:
            await self._take_over(unheld)

    def _unheld_twice(self, indexed: list[OwnedSession]) -> dict[str, bytes]:
        """The sessions of the index the host held in no state at this round
        and the last, with the same fence (and that the sweep is not
        claiming at its own pace): session id -> fence."""
        unheld = _fences(o for o in indexed if not self.host.holds(o.fence.session_id))
        sweeping = self.parked.sweeping(self.host.instance_id)
        twice = _seen_twice(self._unheld, unheld)
        self._unheld = unheld
        return {sid: unheld[sid] for sid in twice - sweeping.keys()}

    def _unwoken_parked(self, indexed: list[OwnedSession]) -> list[str]:
        """The sessions of the index the host holds parked while their bell
        rang, at this round and the last, with the same fence."""
        unwoken = _fences(
            o for o in indexed if o.input_waiting and o.fence.session_id in self.host.parked
        )
        twice = _seen_twice(self._unwoken, unwoken)
        self._unwoken = unwoken
        return sorted(twice)

    async def _take_over(self, unheld: dict[str, bytes]) -> None:
        """Take over the unheld sessions whose owner record still names the
        fence seen twice here."""
        host = self.host
        owned = await self.hooks.list_instance_sessions(host.deployment_id, host.instance_id)
        orphans = [
            o
            for o in owned
            if unheld.get(o.fence.session_id) == o.fence.SerializeToString()
            and not host.holds(o.fence.session_id)
        ]
        if not orphans:
            return
        won, _ = await claim_all(host, orphans)
        # The others were finalized (their index entry is dropped by the
        # takeover attempt) or taken by someone else.
        if won:
            metrics.RECONCILED.labels("taken_over").inc(won)
            self._log.warning(
                "sessions indexed here had no run: taken over again",
                sessions=won,
                session_ids=[o.fence.session_id for o in orphans[:10]],
            )
        if won < len(orphans):
            self._log.info(
                "index entries of finalized or moved sessions dropped",
                sessions=len(orphans) - won,
            )


def _fences(owned: Iterable[OwnedSession]) -> dict[str, bytes]:
    """Session id -> its fence as listed (compared between rounds)."""
    return {o.fence.session_id: o.fence.SerializeToString() for o in owned}


def _seen_twice(last: dict[str, bytes], now: dict[str, bytes]) -> set[str]:
    """The sessions in both sightings, with the same fence."""
    return {sid for sid, fence in now.items() if last.get(sid) == fence}
