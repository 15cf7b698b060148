"""The etcd commit protocol of a worker's checkpoints: what makes a finalized checkpoint count.

:class:`EtcdCommitter` is the ``commit`` (and ``forget``) of a
:class:`~rallypoint.workers.checkpoints.checkpointer.SliceCheckpointer`: it writes a commit
(:class:`~rallypoint.etcd.commits.CheckpointCommit`) to etcd at its own key
``keys.worker_commit(worker, job, slice, step)`` in a transaction guarded on the worker's
incarnation, so a zombie incarnation can neither commit nor delete a commit
(:class:`~rallypoint.workers.errors.CommitRefused`). The worker's etcd user may write no other
commit key: the job's leader checks the commit (the worker holds the slice, the path is in the
run's slice directory) when the worker reports it and promotes it to ``keys.checkpoint(job,
slice, step)`` (:mod:`rallypoint.orchestrator.job.promote`); a forgotten commit stops counting
at once (:func:`rallypoint.etcd.commits.read_commits` counts a promoted commit only while the
worker's own is there).
"""

from __future__ import annotations

import json
import os
import time

from tenacity import Retrying

from rallypoint.basics.clock import Clock, SystemClock
from rallypoint.basics.errors import WriteIndeterminate
from rallypoint.basics.logs import get_logger
from rallypoint.basics.retry import retrying
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import Compare, Delete, Put, Store, key_missing, unchanged_since
from rallypoint.workers.errors import CheckpointError, CommitRefused, StillCommitted

__all__ = ["COMMIT_RETRY_S", "EtcdCommitter", "etcd_commit"]

COMMIT_RETRY_S = 30.0
"""How long a commit is retried while etcd is unreachable."""


class EtcdCommitter:
    """A ``commit`` for :class:`~rallypoint.workers.checkpoints.checkpointer.SliceCheckpointer` that writes the commit JSON at
    ``keys.worker_commit(worker, job, slice, step)`` in a transaction guarded by ``guard``:
    ``created_at(keys.worker(worker_id), incarnation)``, so a zombie incarnation
    cannot commit (:class:`CommitRefused`). Unreachable etcd is retried for
    ``COMMIT_RETRY_S`` of ``clock`` (the shared policy: :func:`rallypoint.basics.retry.retrying`);
    an indeterminate write is resolved by reading the key back.
    :meth:`forget` deletes a commit (before retention deletes its checkpoint).
    """

    def __init__(self, store: Store, keys: Keys, guard: Compare, *, clock: Clock | None = None) -> None:
        if guard.target != "create" or guard.op != "==" or not guard.key.startswith(keys.workers):
            raise ValueError(f"the commit guard must be created_at(keys.worker(worker_id), incarnation), got {guard}")
        self.store, self.keys, self.guard = store, keys, guard
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.worker, self.incarnation = keys.tail(guard.key, keys.workers)[0], int(guard.value)
        self.log = get_logger("rallypoint.checkpoint", worker=self.worker, incarnation=self.incarnation)

    def _retrying(self, what: str) -> Retrying:
        return retrying(clock=self.clock, what=what, log=self.log, stop_after_s=COMMIT_RETRY_S,
                        initial_s=0.05, max_s=1.0)

    def _refused(self, what: str) -> CommitRefused:
        return CommitRefused(f"worker {self.worker} incarnation {self.incarnation}",
                             f"its incarnation is over; {what} refused")

    def __call__(self, c: CheckpointCommit) -> None:
        key = self.keys.worker_commit(self.worker, c.job, c.slice_name, c.step)
        value = json.dumps(c.to_json() | {"worker": self.worker, "incarnation": self.incarnation, "at": time.time()})
        for attempt in self._retrying(f"checkpoint commit {c.job}/{c.slice_name}@{c.step}"):
            with attempt:
                try:
                    r = self.store.txn([self.guard], [Put(key, value)])
                except WriteIndeterminate:
                    kv = self.store.get(key)
                    if kv is not None and kv.value == value.encode():
                        return
                    raise
                if not r.succeeded:
                    raise self._refused(f"commit of {c.job}/{c.slice_name} step {c.step}")

    def forget(self, job: str, slice_name: str, step: int, path: str | None = None) -> None:
        """Delete the commit of ``slice_name`` at ``step``: that checkpoint no longer counts.

        With ``path``, only a commit naming that directory is deleted (one naming another
        writer's directory stays). Raises :class:`CommitRefused` when this incarnation is
        over, and :class:`StillCommitted` when the job's commit of that step names ``path`` and
        still counts as another worker's (this worker may not end it): the caller keeps the
        directory either way.
        """
        self._check_not_others(job, slice_name, step, path)
        key = self.keys.worker_commit(self.worker, job, slice_name, step)
        for attempt in self._retrying(f"forget checkpoint commit {job}/{slice_name}@{step}"):
            with attempt:
                for _ in range(8):  # the key changed between the read and the delete: look again
                    kv = self.store.get(key)
                    ours = kv is not None and (path is None or _same_path(_commit_path(kv.value), path))
                    at = unchanged_since(key, kv.mod_revision) if kv is not None else key_missing(key)
                    if self.store.txn([self.guard, at], [Delete(key)] if ours else []).succeeded:
                        return
                    if not self.store.txn([self.guard], []).succeeded:
                        raise self._refused(f"forgetting the commit of {job}/{slice_name} step {step}")
                raise CheckpointError(f"the commit of {job}/{slice_name} step {step} kept changing while "
                                      "it was being forgotten")


    def _check_not_others(self, job: str, slice_name: str, step: int, path: str | None) -> None:
        """Raise :class:`StillCommitted` when the job's commit of the step names ``path`` and counts as another
        worker's (its own commit names the same directory)."""
        if path is None:
            return
        kv = self.store.get(self.keys.checkpoint(job, slice_name, step))
        if kv is None or not _same_path(_commit_path(kv.value), path):
            return
        try:
            other = json.loads(kv.value).get("worker")
        except (ValueError, AttributeError):
            return
        if not isinstance(other, str) or not other or other == self.worker:
            return
        src = self.store.get(self.keys.worker_commit(other, job, slice_name, step))
        if src is not None and _same_path(_commit_path(src.value), path):
            raise StillCommitted(f"the commit of {job}/{slice_name} step {step} at {path} is worker {other}'s and "
                                 "still counts: its directory stays until the job's leader ends it")


def _commit_path(value: bytes) -> str | None:
    try:
        path = json.loads(value).get("path")
    except (ValueError, AttributeError):
        return None
    return path if isinstance(path, str) else None


def _same_path(a: str | None, b: str) -> bool:
    return a is not None and os.path.normpath(a) == os.path.normpath(b)


def etcd_commit(store: Store, keys: Keys, guard: Compare, *, clock: Clock | None = None) -> EtcdCommitter:
    """The :class:`EtcdCommitter` of one worker incarnation."""
    return EtcdCommitter(store, keys, guard, clock=clock)
