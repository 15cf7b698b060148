"""A loaded job's checkpoints on one worker: when each slice saves, what it restores.

Every slice that holds states saves them at the steps divisible by the job's
``checkpoint_every`` and at the job's last step, ``steps`` (the final cut: every job
commits its final state), the same steps on every slice, so together they form a
consistent cut: the checkpoint at step ``c`` holds each state as at the start of
step ``c``, saved once the slice has run all its instances of steps below ``c`` and
before it runs any later one (:meth:`JobCheckpoints.barrier`). Saving is Orbax's
asynchronous save through :class:`rallypoint.workers.checkpoints.checkpointer.SliceCheckpointer`; the commit
(etcd, guarded on this worker's incarnation) is made after Orbax finalizes, then a
copy of it is written beside the checkpoints (``<root>/commits/<slice>/<step>.json``,
what ``rallypoint resume`` reads when etcd itself was lost) and the coordinator hears
of it through the job's event stream.

Layout of a run's checkpoint root: ``<root>/<slice>/<writer>/<step>/`` (plain Orbax steps,
one directory per checkpointer: ``<worker>-i<incarnation>-<hex>``),
``<root>/commits/<slice>/<step:012d>.json``, ``<root>/jobspec.pb``.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from rallypoint.basics.logs import get_logger
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.etcd.commits import CheckpointCommit, commit_record_path
from rallypoint.workers import meter
from rallypoint.workers.gang.checkpoint import GangCheckpointer
from rallypoint.workers.checkpoints.checkpointer import SliceCheckpointer
from rallypoint.workers.checkpoints.checksums import binding, run_of, state_checksum
from rallypoint.workers.checkpoints.restore import States, restore_commit
from rallypoint.workers.faults import NO_FAULTS, WorkerFaults
from rallypoint.workers.residency import Copies, to_host
from rallypoint.workers.errors import CheckpointCorrupt, LoadError, RestoreError

CommitFn = Callable[[CheckpointCommit], None]
FINAL_RETRY_S = 2.0
"""How often a slice tries its final save again after one failed."""


Fetch = Callable[[pb.CheckpointRef], "States | None"]
"""A copy of a commit's states from the in-memory tier (checksum checked), or None."""


def restore(req: pb.LoadJobRequest, fetch: Fetch | None = None,
            tiers: dict[str, str] | None = None, skip: Collection[str] = ()) -> dict[str, States]:
    """Each slice's states from its commit in ``req.restore``: the nearest valid copy, a
    peer's memory (``fetch``, see :mod:`rallypoint.workers.checkpoints.replicas`) first, then the disk
    (checksums checked). ``tiers`` gets ``{slice: "memory" | "disk"}``. A commit is read from
    disk only inside its slice's directory of the run, ``<req.checkpoint_dir>/<slice>``.

    Raises:
        workers.checkpoint.CheckpointCorrupt: a checkpoint on disk does not read back as committed,
            or its path lies outside the slice's directory (or the request names no directory).
    """
    out: dict[str, States] = {}
    for ref in req.restore:
        if ref.slice in skip:
            continue
        t0 = time.perf_counter()
        states, tier = (fetch(ref) if fetch is not None else None), "memory"
        if states is None:  # a verification restores the verified job's commit, bound to that job's name
            job = req.verify.job if req.HasField("verify") else req.job
            commit = CheckpointCommit(job, ref.slice, int(ref.step), ref.path, ref.checksum)
            if not req.checkpoint_dir:
                raise CheckpointCorrupt(commit, None, "the load request names no checkpoint directory to read "
                                                      "it from")
            states, tier = restore_commit(commit, Path(req.checkpoint_dir) / ref.slice), "disk"
        out[ref.slice] = states
        if tiers is not None:
            tiers[ref.slice] = tier
        meter.checkpoint_restored(req.job, tier, time.perf_counter() - t0)
        get_logger("rallypoint.checkpoint", job=req.job, slice=ref.slice).info(
            "checkpoint.restored", step=int(ref.step), tier=tier, restore_s=round(time.perf_counter() - t0, 4),
            bytes=sum(int(x.nbytes) for leaves in states.values() for x in leaves))
    return out


def restore_for_load(req: pb.LoadJobRequest, fetch: Fetch | None = None,
                     tiers: dict[str, str] | None = None, skip: Collection[str] = ()) -> dict[str, States]:
    """What a runtime starting at ``req.start_step`` (> 0) restores, every slice with states included
    (from the nearest valid copy: see :func:`restore`), but those of ``skip`` (multi-host slices, whose
    members read their own shards: :func:`rallypoint.workers.gang.checkpoint.restore_for_gang`).

    Raises:
        LoadError: a slice with states has no checkpoint in the request.
        RestoreError: a checkpoint does not read back as committed (typed: the executor drops its commit).
    """
    missing = sorted({sa.slice for sa in req.slices if any(st.slice == sa.slice for st in req.states)}
                     - {ref.slice for ref in req.restore})
    if missing:
        raise LoadError(f"start step {req.start_step} needs a checkpoint of slices {missing} to restore")
    try:
        return restore(req, fetch, tiers, skip)
    except CheckpointCorrupt as exc:
        raise RestoreError.corrupt(exc) from exc


class JobCheckpoints:
    """The checkpointers of one job's slices on this worker.

    Args:
        req: the load request (checkpoint settings, slices, states, start step).
        commit_factory: makes the etcd commit function of this incarnation; None
            (or no ``checkpoint_every`` / ``checkpoint_dir``): no checkpoints.
        on_commit: called with ``(slice, step)`` once a checkpoint counts.
        log_fields: bound to every log event.
        faults: test fault hooks (a commit delay, failing saves); none in production.
        replicate: called with each commit and its states once it counts (the
            in-memory tier's :meth:`rallypoint.workers.checkpoints.replicas.Replicator.submit`).
        copies: where the states' copies off the device are counted (``checkpoint``).
        gangs: slice -> its checkpointer's maker, for each multi-host slice here, whose members save
            their own shards (``functools.partial`` of
            :class:`rallypoint.workers.gang.checkpoint.GangCheckpointer` with its group).
    """

    def __init__(self, req: pb.LoadJobRequest, *, commit_factory: Callable[[], CommitFn] | None,
                 on_commit: Callable[[str, int], None], log_fields: Mapping[str, Any],
                 faults: WorkerFaults = NO_FAULTS,
                 replicate: Callable[[CheckpointCommit, States], None] | None = None,
                 copies: Copies | None = None, gangs: Mapping[str, Any] | None = None,
                 on_verified: Callable[[pb.VerifiedState], None] | None = None) -> None:
        self.job = req.job
        self.verify = req.verify if req.HasField("verify") else None  # a verification: compare, save nothing
        self._on_verified = on_verified
        self.gangs = dict(gangs or {})  # slice -> the maker of a multi-host slice's checkpointer
        self.copies = copies
        self._replicate = replicate
        self.faults = faults
        self.steps = int(req.steps)
        self.every = int(req.checkpoint_every)
        self.root = Path(req.checkpoint_dir) if req.checkpoint_dir else None
        self._on_commit = on_commit
        self.log = get_logger("rallypoint.checkpoint", job=req.job, **dict(log_fields))
        assigned = {sa.slice for sa in req.slices}
        self.slices = sorted({st.slice for st in req.states} & assigned)  # slices that hold states
        self.enabled = bool(self.every > 0 and self.slices and (
            self.verify is not None or (self.root is not None and commit_factory is not None)))
        start = int(req.start_step)
        self._extra: set[int] = set()  # steps a drain asked for, off the every-K schedule
        self._retry_at: dict[str, float] = {}  # slice -> when its failed final save is tried again (monotonic)
        first = self._after(start) if self.every > 0 and start < self.steps else math.inf
        if self.verify is not None:  # its one "save": the state at the verified step, compared
            first = int(self.verify.commit.step)
        self.next: dict[str, float] = {s: first for s in self.slices}
        self._already = {(ref.slice, int(ref.step)) for ref in req.committed}
        self.cut = start
        self._ckpt: dict[str, SliceCheckpointer] = {}
        self._keep = int(req.keep_checkpoints) or None
        self._log_fields = dict(log_fields)
        if self.enabled and self.verify is None:
            assert commit_factory is not None
            self._commit = commit_factory()
            for s in self.slices:
                try:
                    self._checkpointer(s)
                except OSError as exc:  # storage full or read-only: the first save tries again
                    self.log.error("checkpoint.unavailable", slice=s, error=f"{type(exc).__name__}: {exc}")

    def _checkpointer(self, s: str) -> SliceCheckpointer:
        """The slice's checkpointer, made on first use (its directory may not be writable at load)."""
        if s not in self._ckpt:
            assert self.root is not None
            mine: dict[str, Any] = dict(job=self.job, slice_name=s, max_to_keep=self._keep,
                                        commit=self._committer(self._commit), log_fields=self._log_fields,
                                        forget=self._forgetter(self._commit, s), writer=self._writer())
            if s in self.gangs:  # its members save their own shards (docs/multihost.md)
                ck: SliceCheckpointer = self.gangs[s](self.root / s, **mine)
            else:
                ck = SliceCheckpointer(self.root / s, replicate=self._replicate, **mine)
            ck.protect(self.cut)
            self._ckpt[s] = ck
        return self._ckpt[s]

    def _writer(self) -> str:
        """A new checkpointer's directory name: whose it is, and unique (a reload gets another)."""
        worker, inc = self._log_fields.get("worker"), self._log_fields.get("incarnation")
        who = f"{worker}-i{inc}-" if worker is not None and inc is not None else "w-"
        name = f"{who}{uuid.uuid4().hex[:8]}"
        return name if len(name) <= 63 and name[0].isalnum() else f"w-{uuid.uuid4().hex[:12]}"

    def _committer(self, commit: CommitFn) -> CommitFn:
        delay = self.faults.commit_delay_s

        def done(c: CheckpointCommit) -> None:
            if delay > 0:  # fault injection: widen the window between Orbax's finalize and the commit
                time.sleep(delay)
            commit(c)  # it counts from here
            assert self.root is not None
            path = commit_record_path(self.root, c.slice_name, c.step)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(c.to_json()))
                os.replace(tmp, path)
            except OSError as exc:
                self.log.warning("checkpoint.record_failed", step=c.step, slice=c.slice_name, error=str(exc))
            self._on_commit(c.slice_name, c.step)
        return done

    def _forgetter(self, commit: CommitFn, slice_name: str) -> Callable[[int, str], None]:
        def forget(step: int, path: str) -> None:
            assert self.root is not None
            forget_commit = getattr(commit, "forget", None)
            if forget_commit is not None:
                forget_commit(self.job, slice_name, step, path)  # raises when fenced: nothing below happens
            record = commit_record_path(self.root, slice_name, step)
            try:
                named = json.loads(record.read_text()).get("path")
            except (OSError, ValueError, AttributeError):
                named = None
            if named is None or os.path.normpath(str(named)) == os.path.normpath(path):
                record.unlink(missing_ok=True)  # the record of another writer's commit of this step stays
        return forget

    def barrier(self, slice_name: str) -> float:
        """The slice may not run instances of this step or later until it saved it (inf: no checkpoints)."""
        return self.next.get(slice_name, math.inf) if self.enabled else math.inf

    def due(self, slice_name: str, low: int) -> int | None:
        """The step to save now: every instance of the slice below it has run (``low``), none above."""
        c = self.barrier(slice_name)
        if c <= self.steps and low >= c and time.monotonic() >= self._retry_at.get(slice_name, 0.0):
            return int(c)
        return None

    def save_failed(self, slice_name: str, step: int) -> None:
        """The slice's save at ``step`` failed (storage full or read-only): a save on the schedule is tried again at
        the next checkpoint step; the final cut, which has none after it, is tried again every
        :data:`FINAL_RETRY_S` until it counts (the job waits for it)."""
        if step == self.steps:
            self.next[slice_name] = step
            self._retry_at[slice_name] = time.monotonic() + FINAL_RETRY_S

    def save_at(self, step: int) -> None:
        """Every slice also saves at ``step`` (a drain's checkpoint; committed like any other).

        A slice already past ``step`` cannot save it; the executor asks only for a step no
        instance of this worker has reached (its grant). Every grant of a drain asks again: a slice
        that saved ``step`` already is not asked to save it twice.
        """
        if not self.enabled or step >= self.steps:
            return
        self._extra.add(step)
        for s in self.slices:
            saved = self._ckpt[s].last_step if s in self._ckpt else None
            if saved is None or step > saved:
                self.next[s] = min(self.next[s], step)

    def _after(self, step: int) -> float:
        """The slice's next checkpoint step after ``step``: the schedule's, an earlier extra one, or the final cut at
        ``steps`` (every job commits its final state); none after the final cut."""
        if step >= self.steps:
            return math.inf
        regular = (step // self.every + 1) * self.every
        return min([regular, self.steps, *(e for e in self._extra if e > step)])

    def save(self, slice_name: str, step: int, states: Mapping[str, Sequence[Any]]) -> None:
        """Save ``states`` as the slice's checkpoint at ``step``: returns once they are copied off the
        device (the one copy, counted as ``checkpoint``); Orbax writes them in the background."""
        if self.verify is not None:
            self.next[slice_name] = math.inf
            self._verified(slice_name, step, states)
            return
        self.next[slice_name] = self._after(step)
        self.faults.check_storage(str(self.root))  # fault injection: the disk is full or read-only
        if (slice_name, step) in self._already:  # a replay reached a step whose checkpoint already counts
            self._on_commit(slice_name, step)
        elif slice_name in self.gangs:  # left on the members, each saving its own shards
            self._checkpointer(slice_name).save(step, states)
        else:
            self._checkpointer(slice_name).save(step, {name: to_host(leaves, self.copies, "checkpoint")
                                                       for name, leaves in states.items()})

    def _verified(self, slice_name: str, step: int, states: Mapping[str, Sequence[Any]]) -> None:
        """A verification reached its step: the checksum of the state it computed, bound to the verified job's
        identity as the primary's commit is, reported with whether it is the commit's."""
        assert self.verify is not None
        ref = self.verify.commit
        host = {name: to_host(leaves, self.copies, "checkpoint") for name, leaves in states.items()}
        got = state_checksum(host, bind=binding(self.verify.job, run_of(ref.path, slice_name), slice_name, step))
        self.log.info("verify.computed", slice=slice_name, step=step, match=got == ref.checksum)
        if self._on_verified is not None:
            self._on_verified(pb.VerifiedState(slice=slice_name, step=step, checksum=got, match=got == ref.checksum))

    def settle_gangs(self, timeout_s: float) -> bool:
        """Wait (bounded) until the multi-host slices' members have pushed the copies of every commit so far (a
        drain, before unloading: the new gang restores from them); whether they did."""
        end = time.monotonic() + timeout_s
        return all([ck.settle(max(0.0, end - time.monotonic())) for s, ck in list(self._ckpt.items())
                    if isinstance(ck, GangCheckpointer)])

    def set_cut(self, cut: int) -> None:
        """The newest consistent cut: checkpoints from it on are kept, older ones may go."""
        if cut <= self.cut:
            return
        old, self.cut = self.cut, cut
        for ck in self._ckpt.values():
            ck.protect(cut)
            ck.release(old)

    def close(self) -> None:
        for ck in self._ckpt.values():
            ck.close()
