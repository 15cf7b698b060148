"""Cluster membership: the pure view of registered workers, and the watch that feeds it.

:class:`MembershipView` turns etcd watch batches (or a full re-read after a
compaction) into :class:`MembershipChange` s: a worker registered, updated, left
(it said so before its lease went), or was lost (its lease expired or was
revoked). It is plain data in, plain data out, tested without etcd.

:class:`MembershipMonitor` runs the watch against the real store: it reads the
current members, watches from that revision + 1, resumes from the last seen
revision + 1 when the stream breaks (etcd restarting), and re-reads everything
when the revision it needs was compacted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from tenacity import RetryCallState

from rallypoint.basics.clock import SYSTEM_CLOCK, Clock
from rallypoint.basics.errors import StoreUnavailable, WatchCompacted
from rallypoint.basics.retry import retrying
from rallypoint.etcd.keys import Keys
from rallypoint.basics.logs import get_logger
from rallypoint.etcd.cluster_view import WorkerInfo
from rallypoint.etcd.records import skip_bad
from rallypoint.etcd.store import KeyValue, Store, WatchBatch


ChangeKind = Literal["registered", "updated", "left", "lost"]


@dataclass(frozen=True, slots=True)
class MembershipChange:
    """One change of membership, at etcd revision ``revision``."""

    kind: ChangeKind
    worker: str
    info: WorkerInfo
    revision: int


class MembershipView:
    """The set of live worker incarnations, maintained from watch events.

    Args:
        keys: the cluster's key schema.
    """

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.workers: dict[str, WorkerInfo] = {}
        self.revision = 0

    def _worker_of(self, key: str) -> str | None:
        if not key.startswith(self.keys.workers):
            return None
        parts = self.keys.tail(key, self.keys.workers)
        return parts[0] if len(parts) == 1 and parts[0] else None

    def resync(self, kvs: Iterable[KeyValue], revision: int) -> list[MembershipChange]:
        """Replace the view with a full read at ``revision``; return what changed."""
        fresh: dict[str, WorkerInfo] = {}
        for kv in kvs:
            w = self._worker_of(kv.key)
            if w is not None and (info := _info(w, kv)) is not None:
                fresh[w] = info
        changes: list[MembershipChange] = []
        for w, old in sorted(self.workers.items()):
            new = fresh.get(w)
            if new is None or new.incarnation != old.incarnation:
                kind: ChangeKind = "left" if old.state == "leaving" else "lost"
                changes.append(MembershipChange(kind, w, old, revision))
        for w, new in sorted(fresh.items()):
            old = self.workers.get(w)
            if old is None or old.incarnation != new.incarnation:
                changes.append(MembershipChange("registered", w, new, revision))
            elif old != new:
                changes.append(MembershipChange("updated", w, new, revision))
        self.workers = fresh
        self.revision = revision
        return changes

    def apply(self, batch: WatchBatch) -> list[MembershipChange]:
        """Apply one watch batch; return the changes in event order."""
        changes: list[MembershipChange] = []
        for ev in batch.events:
            w = self._worker_of(ev.kv.key)
            if w is None:
                continue
            old = self.workers.get(w)
            if ev.type == "delete":
                prev = (_info(w, ev.prev) if ev.prev is not None else None) or old
                self.workers.pop(w, None)
                if prev is not None:
                    kind: ChangeKind = "left" if prev.state == "leaving" else "lost"
                    changes.append(MembershipChange(kind, w, prev, ev.kv.mod_revision))
                continue
            new = _info(w, ev.kv)
            if new is None:
                continue  # a malformed record (logged and counted): the view keeps what it had
            self.workers[w] = new
            if old is not None and old.incarnation != new.incarnation:
                # A delete we never saw: the old incarnation is gone.
                changes.append(MembershipChange("lost", w, old, ev.kv.mod_revision))
            if old is None or old.incarnation != new.incarnation:
                changes.append(MembershipChange("registered", w, new, ev.kv.mod_revision))
            else:
                changes.append(MembershipChange("updated", w, new, ev.kv.mod_revision))
        self.revision = max(self.revision, batch.revision)
        return changes


def _info(worker: str, kv: KeyValue) -> WorkerInfo | None:
    """The worker record at ``kv``, or None for a malformed one (logged and counted: rallypoint.etcd.records)."""
    return skip_bad(lambda: WorkerInfo.from_kv(worker, kv))


class MembershipMonitor:
    """Watches the workers prefix and calls ``on_change`` for each change, from its own thread.

    Args:
        store: the coordination store.
        keys: the cluster's key schema.
        on_change: called with each :class:`MembershipChange`; changes for the
            members present at start are delivered as ``registered``.
        should_run: the monitor stops once this returns False (e.g. leadership lost).
        reconnect_budget_s: how long one outage may last before the monitor gives
            up and reports failure through ``on_failure``.
    """

    def __init__(
        self,
        store: Store,
        keys: Keys,
        on_change: Callable[[MembershipChange], None],
        *,
        should_run: Callable[[], bool] = lambda: True,
        on_failure: Callable[[BaseException], None] | None = None,
        reconnect_budget_s: float = 60.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.keys = keys
        self.view = MembershipView(keys)
        self.on_change = on_change
        self.should_run = should_run
        self.on_failure = on_failure
        self.reconnect_budget_s = reconnect_budget_s
        self.clock = clock
        self.watch_restarts = 0
        self.resyncs = 0
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread: threading.Thread | None = None
        self._healthy_at = 0.0
        self.log = get_logger("rallypoint.membership", cluster=keys.cluster)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        w = self._watch
        if w is not None:
            w.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _running(self) -> bool:
        return not self._stop.is_set() and self.should_run()

    def _emit(self, changes: list[MembershipChange]) -> None:
        for c in changes:
            self.on_change(c)

    def resync(self) -> None:
        """Re-read every worker and emit the difference from the current view."""
        kvs, rev = self.store.get_prefix(self.keys.workers)
        self.resyncs += 1
        self._emit(self.view.resync(kvs, rev))

    def _watch_once(self) -> None:
        self._watch = self.store.watch_prefix(self.keys.workers, self.view.revision + 1)
        try:
            for batch in self._watch:
                self._healthy_at = self.clock.monotonic()
                if not self._running():
                    return
                self._emit(self.view.apply(batch))
        finally:
            self._watch.cancel()

    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        self.log.warning("membership.watch_retry", attempt=state.attempt_number, error=str(exc))
        self.watch_restarts += 1

    def _outage_too_long(self) -> bool:
        return self.clock.monotonic() - self._healthy_at > self.reconnect_budget_s

    def _attempt(self) -> None:
        if self.view.revision == 0:
            self.resync()
            self._healthy_at = self.clock.monotonic()
        try:
            self._watch_once()
        except WatchCompacted as exc:
            self.log.warning(
                "membership.watch_compacted", requested=exc.requested_revision, compacted=exc.compact_revision
            )
            self.resync()
            self._healthy_at = self.clock.monotonic()
            raise StoreUnavailable("re-read after compaction; watching again") from None
        if self._running():
            raise StoreUnavailable("watch ended")

    def _run(self) -> None:
        """Watch until stopped. Each outage is retried (the shared policy, on the injected clock) for at
        most ``reconnect_budget_s`` from the last moment the watch was healthy."""
        self._healthy_at = self.clock.monotonic()

        def attempt() -> None:
            if self._running():
                self._attempt()

        try:
            retrying(clock=self.clock, what="membership watch", retry_on=StoreUnavailable,
                     should_stop=self._outage_too_long, initial_s=0.05, max_s=1.0, jitter_s=0.05,
                     before_sleep=self._log_retry)(attempt)
        except Exception as exc:  # noqa: BLE001 - an outage past the budget, an error no retry mends (a read etcd
            # refuses), or a bug: said aloud and reported, never a thread that ends in silence
            if self._running():
                self.log.error("membership.watch_failed", error=str(exc), budget_s=self.reconnect_budget_s)
                if self.on_failure is not None:
                    self.on_failure(exc)
