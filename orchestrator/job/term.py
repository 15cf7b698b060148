"""A job's etcd, under the term that started it: fenced writes, outages ridden out, hand-off.

:class:`JobTerm` is how every part of a job reaches etcd. Every write goes through
the job's :class:`~rallypoint.orchestrator.control.election.TermWriter`, so only the term that
started the job writes for it; :meth:`JobTerm.until_etcd` retries a call through an
etcd outage (tenacity on the injected clock) while the term holds; :meth:`JobTerm.hold`
returns while the term holds, waits out an outage, and raises
:class:`~rallypoint.orchestrator.job.state.HandedOff` once the term is over. It also
reads and drops the job's checkpoint commits, fences lost workers and checks
registrations: the etcd facts a recovery acts on.

It owns ``stop_reason`` (the coordinator stepped down) and nothing of the job's progress
or placement.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from rallypoint.basics.clock import Clock
from rallypoint.basics.errors import NotLeader, StoreError
from rallypoint.basics.retry import retrying
from rallypoint.etcd.commits import CheckpointCommit, commit_record_path, consistent_cut, read_commit_records, \
    read_commits
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import TXN_OPS, Delete, Get, Op, Store
from rallypoint.orchestrator.control.devices import DeviceLeases, fence_worker
from rallypoint.orchestrator.control.election import LeaderElection, TermWriter
from rallypoint.orchestrator.job.promote import places_of_record, promote, promote_pending, prune_others
from rallypoint.orchestrator.job.state import HandedOff, JobFailed
from rallypoint.recovery.load_plan import SlicePlace

ETCD_OUTAGE_S = 600.0  # how long the job waits for etcd (its quorum) before it fails

T = TypeVar("T")
Commits = Mapping[str, list[CheckpointCommit]]


class JobTerm:
    """One job's etcd access under its term (see the module doc).

    Args:
        job: the job's name.
        store, keys: the coordination store and the cluster's key schema.
        election: the leader's election; the job writes under the term it has now.
        clock: the injected clock (outage retries sleep on it).
        log: the executor's bound logger.
        on_unpaused: called when a pause (etcd away) ends with the term still held.
        resume: the job resumes or is adopted (a cut may come from the commit records beside the checkpoints).
    """

    def __init__(self, job: str, *, store: Store, keys: Keys, election: LeaderElection, clock: Clock, log: Any,
                 on_unpaused: Callable[[], None] = lambda: None, resume: bool = False) -> None:
        self.job, self.store, self.keys, self.election, self.clock, self.log = job, store, keys, election, clock, log
        self.term = election.term or 0
        self.writer = TermWriter(election, self.term)  # this job writes under the term that started it, or not at all
        # The cluster's device leases, written under this term only: built once, as the term and writer are.
        self._leases = DeviceLeases(store, keys, fenced_txn=self.writer.txn, term=self.term, clock=clock,
                                    lease=self._leader_lease)  # on the leader's lease (control/devices.py)
        self.on_unpaused = on_unpaused
        self.run_dir: Path | None = None  # where commit records lie beside the checkpoints (:meth:`open_run`)
        # Where the job's slices run (the placement's view) and its step count: what a worker's commit is checked
        # against before it is promoted (job/promote.py). Set by the executor once its placement is made.
        self.places: Callable[[], Mapping[str, SlicePlace]] = dict
        self.steps = 0
        self.resume = resume
        self._stop_reason: str | None = None
        self._interrupt: BaseException | None = None
        self._stop_lock = threading.Lock()

    # -- the term ---------------------------------------------------------------------------

    def _leader_lease(self) -> int:
        """The etcd lease of this coordinator's term (device leases hang on it); 0 when it holds none."""
        _term, keeper = self.election.held()
        return int(getattr(keeper, "lease_id", 0) or 0)

    def open_run(self, run_dir: Path | None) -> None:
        """The run's directory, once the executor has made or found it: a resume reads commit records there."""
        self.run_dir = run_dir

    def stop(self, reason: str) -> None:
        """This coordinator's term ended: the job hands off at its next :meth:`hold` (thread-safe)."""
        with self._stop_lock:
            if self._stop_reason is None:
                self._stop_reason = reason

    def interrupt(self, exc: BaseException) -> None:
        """End the job at its next :meth:`hold` with ``exc`` (a cancel at once; thread-safe). Every wait of
        the job (placing, loading, a recovery) holds the term as it waits, so none outlasts it."""
        with self._stop_lock:
            if self._interrupt is None:
                self._interrupt = exc

    @property
    def over(self) -> bool:
        return self.writer.over

    def _check(self) -> None:
        with self._stop_lock:
            exc, self._interrupt = self._interrupt, None
        if exc is not None:  # raised once: the cleanup after it holds the term as usual
            raise exc
        if self._stop_reason is not None:
            raise HandedOff(f"the coordinator stepped down: {self._stop_reason}")
        if self.writer.over:
            raise HandedOff(f"term {self.term} is over")
        if not self.writer.holds:
            raise NotLeader(f"job {self.job}", f"term {self.term} is not held right now")
        self.election.check()

    def hold(self) -> None:
        """Return while the term holds; wait out an etcd outage; hand off when the term is over.

        A leader whose lease deadline passed (etcd unreachable, or its quorum lost) is
        not deposed yet: if etcd answers before the lease expires, the coordinator takes
        the same term again and the job goes on where it was (``on_unpaused``).
        """
        try:
            self._check()
            return
        except NotLeader as exc:
            self.log.warning("job.paused", reason=exc.reason)
        try:
            retrying(clock=self.clock, what="holding the term", log=self.log, retry_on=NotLeader,
                     stop_after_s=ETCD_OUTAGE_S, initial_s=0.25, max_s=0.25, jitter_s=0.0)(self._check)
        except NotLeader as exc:
            raise JobFailed(f"etcd stayed unreachable for {ETCD_OUTAGE_S:.0f}s ({exc.reason}); the next leader "
                            f"adopts the job, or resume it with `rallypoint resume {self.job}`") from None
        self.log.info("job.unpaused")
        self.on_unpaused()

    def until_etcd(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried while etcd is unreachable (up to ``ETCD_OUTAGE_S``) and the term holds."""
        try:
            return retrying(clock=self.clock, what=what, log=self.log, retry_on=StoreError, stop_after_s=ETCD_OUTAGE_S,
                            initial_s=0.25, max_s=1.0, before_sleep=lambda _s: self.hold())(fn)
        except StoreError as exc:
            raise JobFailed(f"{what}: etcd stayed unreachable for {ETCD_OUTAGE_S:.0f}s ({exc})") from None

    def txn(self, success: list[Op]) -> None:
        """A fenced write of this term (raises :class:`NotLeader` or :class:`StoreError`)."""
        self.writer.txn([], success)

    def write_quietly(self, what: str, success: list[Op]) -> bool:
        """A fenced write that may fail (etcd away, term lost): logged, not raised. False when it failed."""
        try:
            self.writer.txn([], success)
            return True
        except (StoreError, NotLeader) as exc:
            self.log.warning(what, error=str(exc))
            return False

    def leases(self) -> DeviceLeases:
        """The device leases, fenced by this job's term."""
        return self._leases

    # -- commits ------------------------------------------------------------------------------

    def promote(self, worker: str, slice_name: str, step: int, *, keep: int = 0, cut: int = 0) -> bool:
        """Worker ``worker`` reported its commit of ``slice_name`` at ``step``: check it and make it the job's
        (job/promote.py), through an etcd outage while the term holds; False when it is refused (logged). Then the
        slice's earlier writers' commits past retention (``keep``, not the ``cut``) go (``prune_others``)."""
        def run() -> bool:
            if promote(self.store, self.keys, self.writer.txn, self.log, job=self.job, worker=worker,
                       slice_name=slice_name, step=step, steps=self.steps, places=self.places(),
                       run_dir=self.run_dir) is None:
                return False
            prune_others(self.store, self.keys, self.writer.txn, job=self.job, slice_name=slice_name, worker=worker,
                         keep=keep, cut=cut)
            return True
        try:
            return self.until_etcd("promoting a checkpoint commit", run)
        except NotLeader as exc:
            self.log.warning("checkpoint.promote_failed", worker=worker, slice=slice_name, step=step, error=str(exc))
            return False

    def commits(self) -> dict[str, list[CheckpointCommit]]:
        """The commits of this run: etcd's, or (etcd lost them: a new cluster) the copies beside the checkpoints.
        Commits the placement's workers wrote and the leader did not promote yet (an event lost) are promoted first."""
        def read() -> dict[str, list[CheckpointCommit]]:
            promote_pending(self.store, self.keys, self.writer.txn, self.log, job=self.job, steps=self.steps,
                            places=self.places() or self._recorded(), run_dir=self.run_dir)
            commits = read_commits(self.store, self.keys, self.job)
            if not commits and self.resume and self.run_dir is not None:
                commits = read_commit_records(self.run_dir)
            return commits
        return self.until_etcd("reading checkpoint commits", read)

    def _recorded(self) -> Mapping[str, SlicePlace]:
        """Before the job is placed (a resumed or adopted run reads its cut first): the placement its record says the
        earlier term had, whose workers' commits that term may not have promoted yet."""
        if not self.resume:
            return {}
        kv = self.store.get(self.keys.job(self.job))
        try:
            return places_of_record(kv.json().get("placement")) if kv is not None else {}
        except (ValueError, AttributeError):
            return {}

    @staticmethod
    def cut_of(commits: Commits, slices: list[str], before: int | None) -> int:
        """The newest consistent cut of ``commits`` over ``slices`` below ``before`` (0: the inits)."""
        if not slices:
            return 0
        return consistent_cut(commits, slices, before=before) or 0

    def drop_commit(self, slice_name: str, step: int) -> None:
        """The commit stops counting in etcd and beside the checkpoints (it did not restore)."""
        def drop() -> None:
            key = self.keys.checkpoint(self.job, slice_name, step)
            kv = self.store.get(key)
            worker = _worker_of(kv.value) if kv is not None else None
            own = [Delete(self.keys.worker_commit(worker, self.job, slice_name, step))] if worker else []
            self.writer.txn([], [Delete(key), *own], [])  # the worker's own goes too, or a sweep would promote it again
        self.until_etcd("dropping a corrupt commit", drop)
        if self.run_dir is not None:
            commit_record_path(self.run_dir, slice_name, step).unlink(missing_ok=True)
        self.log.warning("checkpoint.decommitted", slice=slice_name, step=step)

    # -- workers ---------------------------------------------------------------------------------

    def fence(self, worker: str, incarnation: int) -> None:
        self.until_etcd(f"fencing worker {worker}",
                        lambda: fence_worker(self.store, self.keys, self.writer.txn, worker, incarnation))

    def registered(self, worker: str, incarnations: set[int]) -> bool:
        """Whether ``worker`` is registered as one of ``incarnations``."""
        kv = self.until_etcd(f"reading worker {worker}", lambda: self.store.get(self.keys.worker(worker)))
        return kv is not None and kv.create_revision in incarnations

    def gone(self, incarnations: Mapping[str, int]) -> dict[str, str]:
        """The workers (worker -> incarnation) whose registration is gone from etcd; none while etcd is away."""
        lost, ws = {}, sorted(incarnations)
        for at in range(0, len(ws), TXN_OPS):  # a round trip per TXN_OPS workers, not one each
            chunk = ws[at:at + TXN_OPS]
            try:
                reads = self.store.txn([], [Get(self.keys.worker(w)) for w in chunk]).reads
            except StoreError:
                return {}  # etcd is away: nobody is declared lost because of that
            for w, kvs in zip(chunk, reads):
                if not kvs or kvs[0].create_revision != incarnations[w]:
                    lost[w] = "its etcd registration is gone (lease expired or fenced)"
        return lost


def _worker_of(value: bytes) -> str | None:
    """The worker a promoted commit names (None: none, or not a record)."""
    import json  # noqa: PLC0415 - beside its one use

    try:
        d = json.loads(value)
    except ValueError:
        return None
    w = d.get("worker") if isinstance(d, dict) else None
    return w if isinstance(w, str) and w else None
