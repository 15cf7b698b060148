"""A worker's checkpoint commit becomes the job's: the leader checks it and promotes it.

A worker's etcd user may write no key of ``jobs/`` (:mod:`rallypoint.etcd.auth`): it writes its
commit at its own ``commits/<worker>/<job>/<slice>/<step:012d>``
(:mod:`rallypoint.workers.checkpoints.committer`) and reports it on its event stream. The job's
leader then promotes it to ``jobs/<job>/checkpoints/<slice>/<step:012d>`` (a write of its term)
only when :func:`why_refused` finds nothing wrong:

* the key's job, slice and step are the record's own;
* the worker holds the slice in the job's placement now (its driver or a member of its gang),
  at the incarnation the commit names;
* the step is one of the job's (1 .. steps) and the path lies in the slice's directory of the
  job's current run (``<run_dir>/<slice>/...``, no ``..``);
* its checksum binds the job, run, slice and step (:mod:`rallypoint.workers.checkpoints.checksums`; a
  multi-host slice's sharded checksum is taken as it is).

A refused commit is logged (``checkpoint.commit_refused``) and never counts. :func:`promote_pending`
promotes what a lost event stream left behind (before a cut is read). A promoted commit names its
worker, and counts only while the worker's own record stays (a worker forgets a commit before its
retention deletes the checkpoint: :func:`rallypoint.etcd.commits.read_commits`).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.records import Fields, skip_bad
from rallypoint.etcd.store import Delete, KeyValue, Op, Put, Store, unchanged_since
from rallypoint.recovery.load_plan import SlicePlace

# The checksum kinds a leader promotes: bound to job, run, slice and step, and a multi-host slice's sharded
# listing (whose binding is its path and the leader's checks: workers/checkpoints/checksums.py).
BOUND_PREFIXES = ("sha256b:", "sha256-shards:")


def places_of_record(placement: Any) -> dict[str, SlicePlace]:
    """A job record's ``placement`` (what the previous term placed: ``JobPlacement.to_json``) as places; a
    malformed entry is left out (its commits are then not promoted, and an older cut is used)."""
    out: dict[str, SlicePlace] = {}
    if not isinstance(placement, dict):
        return out

    def one(d: Any) -> SlicePlace:
        return SlicePlace(str(d["worker"]), "", int(d["incarnation"]), tuple(int(x) for x in d.get("devices", ())))

    for name, d in placement.items():
        try:
            members = tuple(one(m) for m in d.get("members", ()))
            out[str(name)] = replace(one(d), members=members)
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return out


def holds(places: Mapping[str, SlicePlace], worker: str, slice_name: str, incarnation: int) -> bool:
    """Whether ``worker`` at ``incarnation`` holds ``slice_name`` (drives it, or is a member of its gang)."""
    p = places.get(slice_name)
    if p is None:
        return False
    return any(m.worker == worker and m.incarnation == incarnation for m in (p, *p.members))


def within(path: str, directory: Path) -> bool:
    """Whether ``path`` (absolute, normalized as given, no ``..``) lies strictly inside ``directory``."""
    if not os.path.isabs(path) or ".." in Path(path).parts:
        return False
    p, d = os.path.normpath(path), os.path.normpath(str(directory))
    return p != d and os.path.commonpath([p, d]) == d


def why_refused(rec: Any, *, job: str, worker: str, slice_name: str, step: int, steps: int,
                places: Mapping[str, SlicePlace], run_dir: Path | None) -> str | None:
    """Why the leader does not promote worker ``worker``'s commit record ``rec`` (None: it may)."""
    if not isinstance(rec, dict):
        return "the record is not a JSON object"
    try:
        c = CheckpointCommit.from_json(rec)
        inc = int(rec["incarnation"])
    except (KeyError, TypeError, ValueError) as exc:
        return f"the record lacks a field or has a bad one ({type(exc).__name__}: {exc})"
    if (c.job, c.slice_name, c.step) != (job, slice_name, step):
        return f"the record says {c.job}/{c.slice_name}@{c.step}, its key {job}/{slice_name}@{step}"
    if not holds(places, worker, slice_name, inc):
        return f"worker {worker} incarnation {inc} does not hold slice {slice_name!r} in the job's placement"
    if not 1 <= step <= steps:
        return f"step {step} is not one of the job's steps 1..{steps}"
    if run_dir is None or not within(c.path, run_dir / slice_name):
        return f"path {c.path!r} is not in the slice's directory of the job's current run ({run_dir})"
    if not c.checksum.startswith(BOUND_PREFIXES):
        return f"checksum {c.checksum[:24]!r} does not bind the job, run, slice and step"
    return None


def promote(store: Store, keys: Keys, txn: Callable[[list[Any], list[Op], list[Op]], Any], log: Any, *, job: str,
            worker: str, slice_name: str, step: int, steps: int, places: Mapping[str, SlicePlace],
            run_dir: Path | None, kv: KeyValue | None = None) -> CheckpointCommit | None:
    """Promote worker ``worker``'s commit of ``slice_name`` at ``step`` (read now unless ``kv`` is given) with a write
    of the term (``txn``); returns it, or None when there is none or it is refused (logged)."""
    if kv is None:
        kv = store.get(keys.worker_commit(worker, job, slice_name, step))
    if kv is None:
        done = store.get(keys.checkpoint(job, slice_name, step))
        if done is not None:  # promoted already (a sweep), or written by a coordinator: it counts as it is
            return skip_bad(lambda: CheckpointCommit.from_kv(done))
        log.warning("checkpoint.commit_refused", worker=worker, slice=slice_name, step=step,
                    reason="the worker reported a commit its own commit key does not hold")
        return None
    rec = skip_bad(lambda: Fields.of(kv, "commit").raw)  # etcd/records.py: the one boundary
    why = why_refused(rec, job=job, worker=worker, slice_name=slice_name, step=step, steps=steps, places=places,
                      run_dir=run_dir)
    if why is not None:
        log.warning("checkpoint.commit_refused", worker=worker, slice=slice_name, step=step, reason=why)
        return None
    txn([unchanged_since(kv.key, kv.mod_revision)], [Put(keys.checkpoint(job, slice_name, step), kv.value)], [])
    return CheckpointCommit.from_json(rec)


def prune_others(store: Store, keys: Keys, txn: Callable[[list[Any], list[Op], list[Op]], Any], *, job: str,
                 slice_name: str, worker: str, keep: int, cut: int) -> int:
    """The retention of other writers' commits of ``slice_name`` (earlier holders: a worker may end only its own):
    each below the ``keep``-th newest of ``worker``'s promoted commits, but the cut's, goes with its writer's own
    commit, as that worker's retention would have deleted it (its directory then goes at ``worker``'s next
    retention). Returns how many went."""
    if keep < 1:
        return 0
    kvs, _ = store.get_prefix(f"{keys.checkpoints(job)}{slice_name}/")
    recs = []
    for kv in kvs:
        try:
            d = json.loads(kv.value)
            recs.append((kv, int(d["step"]), d.get("worker")))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    mine = sorted(step for _kv, step, w in recs if w == worker)
    if len(mine) < keep:
        return 0
    keep_from = mine[-keep]
    gone = 0
    for kv, step, w in recs:
        if w != worker and isinstance(w, str) and w and step < keep_from and step != cut:
            txn([unchanged_since(kv.key, kv.mod_revision)],
                [Delete(kv.key), Delete(keys.worker_commit(w, job, slice_name, step))], [])
            gone += 1
    return gone


def promote_pending(store: Store, keys: Keys, txn: Callable[[list[Any], list[Op], list[Op]], Any], log: Any, *,
                    job: str, steps: int, places: Mapping[str, SlicePlace], run_dir: Path | None) -> int:
    """Promote every commit of ``job`` its placement's workers wrote and the leader has not promoted (an event
    stream that ended first); returns how many."""
    promoted = {kv.key for kv in store.get_prefix(keys.checkpoints(job))[0]}
    workers = {m.worker for p in places.values() for m in (p, *p.members)}
    done = 0
    for w in sorted(workers):
        kvs, _ = store.get_prefix(f"{keys.worker_commits(w)}{job}/")
        for kv in kvs:
            try:
                slice_name, step = keys.tail(kv.key, f"{keys.worker_commits(w)}{job}/")
                key = keys.checkpoint(job, slice_name, int(step))
            except ValueError:
                continue
            if key not in promoted and promote(store, keys, txn, log, job=job, worker=w, slice_name=slice_name,
                                               step=int(step), steps=steps, places=places, run_dir=run_dir,
                                               kv=kv) is not None:
                done += 1
    return done
