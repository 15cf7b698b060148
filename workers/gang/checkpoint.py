"""A multi-host slice's checkpoints: each member saves and restores its own shards; nothing is gathered.

A slice on one worker copies its states to the host and hands them to Orbax
(:class:`~rallypoint.workers.checkpoints.checkpointer.SliceCheckpointer`). A multi-host slice's states
live on its members, each holding only its shards, so its lead never holds a whole leaf
(docs/multihost.md):

* **Save** (:class:`GangCheckpointer`): the members write one Orbax multi-process
  checkpoint (``StandardSave`` of ``{state: [leaves]}``, the same tree a one-worker slice
  writes), each its own shards, into a temporary step directory; each answers the
  digests of the shards it holds the first replica of, once Orbax has its host copy (the
  writing goes on in the background, as a one-worker slice's does). When every member has
  written (the commit thread asks), the lead writes the digests as
  ``shards.json`` beside the checkpoint, renames the directory to its step (the
  finalize: a save cut short leaves only a temporary directory, never a step), and
  commits ``sha256-shards:<hex>`` (:mod:`rallypoint.workers.checkpoints.checksums`): one commit for
  the slice, through the same commit thread, retention and fencing as any slice.
* **Restore** (:func:`restore_on_gang`): the members read the checkpoint back, each its
  own shards, laid out as the state's init lays it out, and answer the digests of what
  they read; the lead compares them with ``shards.json`` and the commit. A checkpoint of
  another layout (saved by a slice on one worker, or split otherwise) is checked by
  gathering it once on the lead instead (:func:`~rallypoint.workers.checkpoints.checksums.checksum_of`).

Either kind restores anywhere: a gang's checkpoint read back in one process
(``restore_commit``: ``rallypoint resume``, the chaos harness's check of every commit) is
checked against its ``shards.json`` leaf by leaf.

The in-memory tier (:mod:`rallypoint.workers.gang.replicas`): with ``targets`` each member
keeps a host copy of its shards at the save and pushes it, once the step commits, to its
own worker and to the part's holder; a restore tries those copies before the disk.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rallypoint.basics.logs import get_logger
from rallypoint.workers import meter
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.workers.checkpoints.checkpointer import SliceCheckpointer, _Pending
from rallypoint.workers.checkpoints.restore import checkpoint_within, metadata_tree
from rallypoint.workers.checkpoints.checksums import (SHARDED, SHARDS_FILE, checksum_of, commit_binding,
                                                      read_listing, shard_entries, shards_checksum)
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.replicas import part_name
from rallypoint.workers.gang.lead import GangSlice, GroupSharding, GroupValue
from rallypoint.workers.gang.replicas import restore_from_parts
from rallypoint.workers.gang.member_parts import KEPT, peer_json
from rallypoint.workers.errors import CheckpointCorrupt, LoadError, RestoreError
from rallypoint.workers.gang.group import GroupError, GroupLost

SAVED_POLL_S = 0.02  # how often the commit thread asks the members whether a step is written
TMP = ".orbax-checkpoint-tmp-"  # Orbax's own marker: its step listing never takes such a directory for a step


class GangSteps:
    """The ``CheckpointManager`` calls a :class:`~rallypoint.workers.checkpoints.checkpointer.SliceCheckpointer` makes, for a
    multi-host slice: a step is written by the members and finalized by the lead's rename."""

    def __init__(self, directory: Path, gang: GangSlice, *, keep: bool = False) -> None:
        self.directory, self.gang, self.keep = Path(directory), gang, keep
        self.directory.mkdir(parents=True, exist_ok=True)
        self._writing: dict[int, tuple[Path, list[dict[str, Any]]]] = {}  # step -> its temporary directory, listing
        self.written: dict[int, str] = {}  # step -> the directory its members saved into (their key for its copies)
        self._lock = threading.Lock()

    def save(self, step: int, tree: Mapping[str, Sequence[GroupValue]]) -> str:
        """Start writing ``step``: returns once every member holds its host copy (they write in the background
        until :meth:`wait_until_finished`); its commit checksum."""
        tmp = self.directory / f"{step}{TMP}{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            rows = self.gang.group.save(str(tmp / "default"), {s: [v.name for v in leaves] for s, leaves in tree.items()},
                                        wait=False, keep=self.keep)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        entries = shard_entries(rows)
        with self._lock:
            self._writing[step] = (tmp, entries)
            self.written[step] = str(tmp / "default")
            for old in sorted(self.written)[:-KEPT]:
                del self.written[old]
        return shards_checksum(entries)

    def take_written(self, step: int) -> str | None:
        """The directory the members saved ``step`` into (their key for its copies), once; None if not kept."""
        with self._lock:
            return self.written.pop(step, None)

    def wait_until_finished(self) -> None:
        """Finalize every step started: once each member has written its shards (a group request), its listing is
        written beside it and its directory renamed to the step. A step that fails is removed (not finalized)."""
        with self._lock:
            writing, self._writing = sorted(self._writing.items()), {}
        errors = []
        for step, (tmp, entries) in writing:
            try:
                while not self.gang.group.saved(str(tmp / "default"), wait=False):  # the slice runs meanwhile
                    time.sleep(SAVED_POLL_S)
                with open(tmp / SHARDS_FILE, "w") as f:
                    json.dump(entries, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(tmp, self.directory / str(step))
            except Exception as exc:  # noqa: BLE001 - the step is not finalized: its commit is never made
                shutil.rmtree(tmp, ignore_errors=True)
                errors.append(exc)
        if errors:
            raise errors[0]

    def all_steps(self) -> list[int]:
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())

    def delete(self, step: int) -> None:
        shutil.rmtree(self.directory / str(step))

    def close(self) -> None:
        """Nothing to close."""


class GangCheckpointer(SliceCheckpointer):
    """A multi-host slice's :class:`~rallypoint.workers.checkpoints.checkpointer.SliceCheckpointer` (see the module doc).

    Its save holds the slice until every member has its host copy (a group request); the
    members write in the background, and the commit thread finalizes the step once they are
    done (another group request) and commits it, with the base class's retention."""

    def __init__(self, slice_dir: Path, *, gang: GangSlice,
                 targets: Callable[[int], Sequence[pb.ReplicaPeer]] | None = None, cluster: str = "",
                 **kwargs: Any) -> None:
        self.gang, self._targets, self._cluster = gang, targets, cluster
        self._sums: dict[int, str] = {}
        self._stashed = -1  # the newest commit whose copies the members were asked to push
        super().__init__(slice_dir, replicate=self._stash if targets is not None else None, **kwargs)

    def _make_manager(self) -> GangSteps:
        return GangSteps(self.directory, self.gang, keep=self._targets is not None)

    def _stash(self, c: CheckpointCommit, _states: Any) -> None:
        """The step counts: each member pushes the copy of its shards it kept at the save to its own worker and
        to its part's holder (workers/gang/replicas.py). On the commit thread; the members push in the background."""
        try:
            self._stash_commit(c)
        finally:
            self._stashed = c.step

    def _stash_commit(self, c: CheckpointCommit) -> None:
        assert self._targets is not None
        directory = self._manager.take_written(c.step)
        if directory is None:
            return
        members = self.gang.members
        extra = [{"part": part_name(c.slice_name, j), "from_worker": m.worker_id, "from_incarnation": m.incarnation,
                  "targets": [peer_json(p) for p in self._targets(j)]} for j, m in enumerate(members)]
        try:
            answers = self.gang.group.request({"op": "stash", "dir": directory, "job": c.job, "step": c.step,
                                               "checksum": c.checksum, "cluster": self._cluster}, extra=extra)
        except (GroupLost, GroupError) as exc:  # the disk has it; the slice's loss is the slice thread's to meet
            self.log.warning("replica.not_stashed", step=c.step, error=str(exc))
            return
        self.log.info("replica.stashing", step=c.step, parts=[e["part"] for e in extra],
                      holders=[[t["worker_id"] for t in e["targets"]] for e in extra],
                      shards=[h.get("shards") for h, _ in answers])

    def _host_tree(self, states: Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
        tree = {str(name): list(leaves) for name, leaves in states.items()}
        stray = [f"{n}[{i}]" for n, leaves in tree.items() for i, v in enumerate(leaves)
                 if not (isinstance(v, GroupValue) and v.gang is self.gang)]
        if stray:
            raise TypeError(f"states {stray} of multi-host slice {self.slice_name!r} are not on its group")
        return tree

    def settle(self, timeout_s: float) -> bool:
        """Wait (bounded) until the copies of every commit so far have been pushed (a drain, before the group
        ends: the new gang restores from them); whether they were."""
        if self._targets is None:
            return True
        end = time.monotonic() + timeout_s
        while self.commits and self._stashed < self.commits[-1].step:
            if time.monotonic() > end:
                return False
            time.sleep(SAVED_POLL_S)
        left = max(0.0, end - time.monotonic())
        try:
            answers = self.gang.group.request({"op": "pushed", "wait_s": left}, timeout_s=left + 5.0)
        except (GroupLost, GroupError):
            return False
        return all(h.get("done") for h, _ in answers)

    def _save_step(self, step: int, tree: dict[str, list[Any]]) -> None:
        self._sums[step] = self._manager.save(step, tree)

    def _checksum(self, item: _Pending) -> str:
        return self._sums.pop(item.step)

    def _finalized_path(self, step: int) -> Path | None:
        p = self.directory / str(step)
        return p if p.is_dir() else None

    def _verify(self, c: CheckpointCommit, path: Path) -> None:
        """Not read back here: no process of a multi-host slice holds its whole state, and each member would
        read back its own shards (not done yet; docs/security.md). A restore checks the shards' digests."""


def _leaf_avals(step_dir: Path) -> dict[str, list[tuple[str, list[int]]]]:
    """Each state's leaves' dtype and shape, as the checkpoint's Orbax metadata records them."""
    return {str(s): [(np.dtype(m.dtype).name, [int(n) for n in m.shape]) for m in leaves]
            for s, leaves in metadata_tree(step_dir / "default").items()}


def _split(entries: Sequence[Any]) -> list[str]:
    """How a listing splits the leaves (each shard's state, leaf and index), in order; of any JSON given."""
    return sorted(json.dumps([e.get("state"), e.get("leaf"), e.get("index")]) if isinstance(e, dict) else "?"
                  for e in entries)


def restore_on_gang(commit: CheckpointCommit, slice_dir: Path, gang: GangSlice,
                    layouts: Mapping[str, Sequence[GroupSharding]]) -> dict[str, list[GroupValue]]:
    """The states ``commit`` names, read by the members of ``gang``, each its own shards, laid out as ``layouts``
    (state -> each leaf's layout on the group), checked against the commit (see the module doc).

    Raises:
        CheckpointCorrupt: the path lies outside ``slice_dir``, the checkpoint cannot be read, lacks a state,
            or is not the bytes committed.
        GroupLost: a member was lost meanwhile (a loss of the slice, not of the checkpoint).
    """
    log = get_logger("rallypoint.checkpoint", job=commit.job, slice=commit.slice_name)
    step_dir = checkpoint_within(commit, slice_dir)
    t0 = time.perf_counter()

    def corrupt(actual: str | None, why: str) -> CheckpointCorrupt:
        log.warning("checkpoint.corrupt", step=commit.step, path=commit.path, expected=commit.checksum,
                    actual=actual, error=why)
        return CheckpointCorrupt(commit, actual, why)

    try:
        avals = _leaf_avals(step_dir)
        if set(avals) != set(layouts):
            raise corrupt(None, f"it holds states {sorted(avals)}, the slice has {sorted(layouts)}")
        values = {s: [gang.value(d, shape) for d, shape in avals[s]] for s in layouts}
        tree = {s: [{"value": v.name, "shape": list(v.shape), "dtype": v.dtype.name, **lay.layout}
                    for v, lay in zip(values[s], layouts[s], strict=True)] for s in layouts}
        rows = gang.group.restore(str(step_dir / "default"), tree)
    except (CheckpointCorrupt, GroupLost):
        raise
    except Exception as e:  # noqa: BLE001 - any other failure to read it is a corrupt checkpoint
        raise corrupt(None, f"{type(e).__name__}: {e}") from e
    got = shard_entries(rows)
    checked = "shards"
    if commit.checksum.startswith(SHARDED):
        try:
            saved = read_listing(step_dir)
        except (OSError, ValueError) as e:
            raise corrupt(None, f"{SHARDS_FILE} unreadable: {type(e).__name__}: {e}") from e
        actual = shards_checksum(got) if _split(got) == _split(saved) else None
    else:
        actual = None
    if actual is None:  # saved otherwise (by a slice on one worker, or split otherwise): checked whole, on the lead
        checked = "gathered"
        actual = checksum_of({s: [np.asarray(v) for v in leaves] for s, leaves in values.items()}, commit.checksum,
                             step_dir, commit_binding(commit))
    if actual != commit.checksum:
        raise corrupt(actual, "the bytes read back are not the ones committed")
    log.info("checkpoint.restored_on_group", step=commit.step, checked=checked, members=len(gang.group.members),
             restore_s=round(time.perf_counter() - t0, 4),
             bytes=sum(v.nbytes for leaves in values.values() for v in leaves))
    return values


def restore_for_gang(req: Any, slice_name: str, gang: GangSlice, layouts: Mapping[str, Sequence[GroupSharding]],
                     tiers: dict[str, str] | None = None) -> dict[str, list[GroupValue]]:
    """A runtime's restore of multi-host slice ``slice_name`` from its checkpoint in the load request ``req``
    (:func:`restore_on_gang`); a corrupt one raises the load's typed ``RestoreError``."""
    ref = next((r for r in req.restore if r.slice == slice_name), None)
    if ref is None or not req.checkpoint_dir:
        raise LoadError(f"start step {req.start_step} needs a checkpoint of multi-host slice {slice_name!r} "
                        "and a checkpoint directory to read it from")
    commit = CheckpointCommit(req.job, ref.slice, int(ref.step), ref.path, ref.checksum)
    t0 = time.perf_counter()
    sources = [[p for p in req.replica_sources if p.slice == part_name(slice_name, j)]
               for j in range(len(gang.group.members))]
    if all(sources):  # each member's part may be in memory: tried first (workers/gang/replicas.py)
        try:
            step_dir = checkpoint_within(commit, Path(req.checkpoint_dir) / slice_name)
        except CheckpointCorrupt as exc:
            raise RestoreError.corrupt(exc) from exc
        values = restore_from_parts(commit, step_dir, gang, layouts, sources, cluster=req.to.cluster)
        if values is not None:
            if tiers is not None:
                tiers[slice_name] = "memory"
            meter.checkpoint_restored(req.job, "memory", time.perf_counter() - t0)
            return values
    try:
        values = restore_on_gang(commit, Path(req.checkpoint_dir) / slice_name, gang, layouts)
    except CheckpointCorrupt as exc:
        raise RestoreError.corrupt(exc) from exc
    if tiers is not None:
        tiers[slice_name] = "disk"
    meter.checkpoint_restored(req.job, "disk", time.perf_counter() - t0)
    return values
