"""A job's runs: each new run of a job name has a run id and a run directory under the checkpoint root.

``ROOT/JOB/<run id>/`` holds the run's checkpoints, its commit records and the job spec
it ran (``jobspec.pb``, what a new leader adopts from); ``ROOT/JOB/LATEST`` names the
newest run, the one ``resume`` and adoption continue. A run id is ``run-<UTC time>-<6 hex>``.

In etcd the job record (``keys.job``) and the commits under ``keys.checkpoints`` are the
current run's. A new run never deletes the previous one: it is refused while the
previous run has commits (:func:`refusal`) unless the submit asks for a new run, and
then the previous run's record and commits move under its run id
(``keys.old_run`` / ``keys.old_run_checkpoints``, :func:`archive_ops`), so an old run's
commits are never read as the new run's. Old runs go only by the coordinators' retention
(``keep_runs``: :func:`prune`) or an explicit delete (:func:`delete_run`).

Every name that reaches the file system from a request or from etcd is checked here:
job names, run ids read from ``LATEST`` or a record, checkpoint directories (only under
the root the coordinator was started with, no ``..``, no symlink out of it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

from rallypoint.basics.errors import ConfigError, RallypointError
from rallypoint.etcd.commits import CheckpointCommit, read_commit_records
from rallypoint.etcd.keys import Keys, check_name
from rallypoint.etcd.records import BadRecord, Fields, parsed, report, skip_bad
from rallypoint.etcd.store import TXN_OPS, Delete, KeyValue, Put, Store
from rallypoint.orchestrator.job.run_files import (JOBSPEC_FILE, LATEST_FILE, bound_run, make_run_dir, read_latest,
                                                   read_spec, spec_digest, write_spec)
from rallypoint.orchestrator.job.state import JobFailed

__all__ = ["JOBSPEC_FILE", "LATEST_FILE", "read_spec", "spec_digest"]  # re-exported from run_files.py

RUN_ID = re.compile(r"^run-\d{8}T\d{6}-[0-9a-f]{6}$")


def valid_name(name: str) -> bool:
    try:
        check_name("run", name)
    except ConfigError:
        return False
    return True


def new_run_id(now: float | None = None) -> str:
    """A new run's id, stamped with the wall time ``now`` (the job's clock; None: the system's)."""
    return time.strftime("run-%Y%m%dT%H%M%S-", time.gmtime(now)) + uuid.uuid4().hex[:6]


def check_run_id(run: str, where: str = "") -> str:
    """``run`` if it can be a run id (a plain folder name: no '/', no '..'), else ConfigError; the ids
    this module makes are ``run-YYYYmmddTHHMMSS-xxxxxx``."""
    try:
        return check_name("run", run)
    except ConfigError:
        raise ConfigError(f"{where or 'run id'} {run!r} is not a run id (a folder name such as "
                          "run-20260101T000000-1a2b3c): `rallypoint status JOB` shows the job's runs") from None


def within(root: Path, path: Path, what: str) -> Path:
    """``path`` resolved (symlinks followed), if it lies in ``root`` resolved; else ConfigError."""
    r, p = root.resolve(), path.resolve()
    if p != r and r not in p.parents:
        raise ConfigError(f"{what} {path} lies outside the checkpoint root {r} (a symlink or a path that leads "
                          "out of it): checkpoints go only under the root the coordinators were started with")
    return p


def request_checkpoint_dir(requested: str, root: str) -> str:
    """The checkpoint directory a request names, checked: "" gives ``root`` (the coordinator's
    ``--checkpoint-dir``); a relative path is taken under ``root``; an absolute one must lie in it.
    No ``..``, no symlink out of the root; a coordinator without a root takes none from requests."""
    if not requested:
        return root
    if "\x00" in requested or ".." in PurePath(requested).parts:
        raise ConfigError(f"checkpoint directory {requested!r}: '..' is not allowed; name a folder under the "
                          "coordinators' --checkpoint-dir (or leave it empty for that root itself)")
    if not root:
        raise ConfigError(f"checkpoint directory {requested!r}: the coordinators were started without "
                          "--checkpoint-dir, so a job cannot name one; start them with --checkpoint-dir ROOT")
    path = Path(requested) if Path(requested).is_absolute() else Path(root) / requested
    return str(within(Path(root), path, "checkpoint directory"))


def check_spec_names(spec: Any) -> None:
    """The names of a job spec that become folders or files (the job; each slice, ``<run>/<slice>/``; each
    node, ``<run>/sources/<node>.jsonl``): each a valid name (no '/', no '..', no leading '.'), else ConfigError
    naming it."""
    check_name("job", spec.job)
    for n in spec.nodes:
        check_name("node", n.name)
    for s in spec.slices:
        check_name("slice", s.slice)
    for n in spec.nodes:
        check_name(f"slice (of node {n.name!r})", n.slice)
    for st in spec.states:
        check_name(f"slice (of state {st.name!r})", st.slice)


def check_init_from(spec: Any, root: str) -> None:
    """Each state's pretrained checkpoint (``init_from``) a worker is to read: an absolute path with no ``..``,
    outside the checkpoint root ``root`` (every job's runs lie there: a job reads another run's states only
    through ``rallypoint export``), else ConfigError naming the state and what to do."""
    for st in spec.states:
        if not st.HasField("init_from"):
            continue
        path = st.init_from.path
        what = f"state {st.name!r}: init_from {path!r}"
        if "\x00" in path or not PurePath(path).is_absolute() or ".." in PurePath(path).parts:
            raise ConfigError(f"{what} must be an absolute path without '..'")
        real, base = Path(path).resolve(), Path(root).resolve() if root else None
        if base is not None and (real == base or base in real.parents):
            raise ConfigError(f"{what} lies under the coordinators' checkpoint root {root}, where every job's runs "
                              "are; a job may not read another run's checkpoints: export them (`rallypoint export`) "
                              "or copy the checkpoint elsewhere")


def run_dir(root: Path, job: str, *, create: bool, run: str = "", record: dict[str, Any] | None = None) -> Path:
    """The checkpoint directory of the job's newest run under ``root`` (a new one, ``run`` or a
    fresh id, when ``create``). The job's folder and the run LATEST names must lie in ``root``;
    ``record``: the job's record in etcd, whose run ``LATEST`` must name when it is bound (run_files.py)."""
    check_name("job", job)
    base = root / job
    if create:
        name = check_run_id(run) if run else new_run_id()
        within(root, base, "job folder")
        return make_run_dir(root, base, name)  # made through the folder opened without following a symlink
    latest = base / LATEST_FILE
    try:
        name = read_latest(base)
    except FileNotFoundError:
        raise JobFailed(f"no run of job {job!r} under {root}: nothing to resume (is --checkpoint-dir right?)") from None
    except OSError as exc:
        raise JobFailed(f"{latest} cannot be read: {exc}") from None
    try:
        check_run_id(name, f"{latest} names")
        bound_run(record, name, latest)
        if (base / name).is_symlink():
            raise ConfigError(f"the run directory {base / name} is a symlink, not a run directory of job {job!r}: "
                              "replace it with the run's folder, then resume again")
        return within(within(root, base, "job folder"), base / name, "run directory")
    except ConfigError as exc:
        raise JobFailed(str(exc)) from None


def adoptable_run_dir(recorded: str, job: str, root: str) -> Path:
    """A ``run_dir`` read back from a job record, checked before adoption reads it: it must be
    ``<root>/.../<job>/<run id>`` inside the coordinator's checkpoint root. ConfigError if not."""
    if not root:
        raise ConfigError("this coordinator was started without --checkpoint-dir: it reads no run directory")
    p = Path(recorded)
    if not p.is_absolute() or ".." in p.parts:
        raise ConfigError(f"the recorded run directory {recorded!r} is not an absolute path without '..'")
    check_run_id(p.name, "the recorded run directory's name")
    if p.parent.name != job:
        raise ConfigError(f"the recorded run directory {recorded} is not one of job {job!r} (<root>/{job}/<run id>)")
    return within(Path(root), p, "the recorded run directory")


def run_of(record: dict[str, Any] | None) -> str:
    """The run id a job record names ('' when it has none)."""
    if not record:
        return ""
    if record.get("run"):
        return str(record["run"])
    rd = record.get("run_dir") or ""
    return Path(rd).name if rd else ""


@dataclass(frozen=True)
class PreviousRun:
    """What a job name has already: its current run's record and commits (etcd's, or on disk)."""

    job: str
    run: str
    state: str
    record: dict[str, Any] | None
    commit_kvs: list[KeyValue] = field(default_factory=list)
    commits: int = 0
    newest_step: int | None = None


def previous_run(store: Store, keys: Keys, job: str, root: Path | None) -> PreviousRun | None:
    """The job name's current run, or None when it has none (in etcd or under ``root``)."""
    kv = store.get(keys.job(job))
    record = parsed(kv, "job")
    kvs, _ = store.get_prefix(keys.checkpoints(job))
    steps = [c.step for k in kvs if (c := skip_bad(lambda k=k: CheckpointCommit.from_kv(k))) is not None]
    run = run_of(record)
    if not kvs and root is not None and (root / job / LATEST_FILE).exists():
        try:  # etcd has none (a new cluster): the copies beside the checkpoints count
            rd = run_dir(root, job, create=False)
            on_disk = read_commit_records(rd)
            steps = [c.step for cs in on_disk.values() for c in cs]
            run = run or rd.name
        except JobFailed:
            pass
    if record is None and not steps:
        return None
    return PreviousRun(job=job, run=run, state=(record or {}).get("state", "unrecorded"), record=record,
                       commit_kvs=kvs, commits=len(steps), newest_step=max(steps) if steps else None)


def refusal(prev: PreviousRun | None) -> str:
    """Why a submit of ``prev``'s job name without ``new_run`` is refused ('' when it is not)."""
    if prev is None or not prev.commits:
        return ""
    return (f"job {prev.job!r} already has a run ({prev.run or 'without a run id'}, {prev.state}) with "
            f"{prev.commits} committed checkpoints up to step {prev.newest_step}; nothing was changed. "
            f"`rallypoint resume {prev.job}` continues that run; to start over, submit with --new-run: the old "
            f"run's files and commits stay under its run id {prev.run} (`rallypoint status {prev.job}`)")


def _chunks(ops: Sequence[Put | Delete]) -> list[list[Put | Delete]]:
    return [list(ops[i:i + TXN_OPS]) for i in range(0, len(ops), TXN_OPS)]


def archive_ops(keys: Keys, prev: PreviousRun | None, now: float) -> list[list[Put | Delete]]:
    """The etcd writes that keep ``prev`` under its run id (superseded at wall time ``now``), in transactions
    that each fit: the copies first, then (last) the delete of the current-run commits. Empty when nothing is
    kept."""
    if prev is None or (prev.record is None and not prev.commit_kvs):
        return []
    rid = prev.run if prev.run and valid_name(prev.run) else new_run_id(now)
    record = dict(prev.record or {"job": prev.job, "state": prev.state})
    ops: list[Put | Delete] = [Put(keys.old_run(prev.job, rid),
                                   json.dumps({**record, "run": rid, "superseded_at": now}))]
    under = keys.checkpoints(prev.job)
    for kv in prev.commit_kvs:
        ops.append(Put(keys.old_run_checkpoints(prev.job, rid) + "/".join(keys.tail(kv.key, under)), kv.value))
    return _chunks(ops) + [[Delete(under, prefix=True)]]


def old_runs(store: Store, keys: Keys, job: str) -> list[dict[str, Any]]:
    """The job name's earlier runs kept in etcd, oldest first: their records (with ``run``) and commit counts."""
    kvs, _ = store.get_prefix(keys.runs(job))
    runs: dict[str, dict[str, Any]] = {}
    commits: dict[str, int] = {}
    for kv in kvs:
        parts = keys.tail(kv.key, keys.runs(job))
        if len(parts) == 2 and parts[1] == "record":
            try:
                f = Fields.of(kv, "run")
                runs[parts[0]] = {**f.raw, "run": parts[0], "superseded_at": f.number("superseded_at")}
            except BadRecord as exc:
                report(exc)
                runs[parts[0]] = {"run": parts[0], "state": "unreadable"}
        elif len(parts) > 2:
            commits[parts[0]] = commits.get(parts[0], 0) + 1
    for rid, r in runs.items():
        r["commits"] = commits.get(rid, 0)
    return sorted(runs.values(), key=lambda r: (float(r.get("superseded_at", 0)), r["run"]))


def delete_run(store: Store, keys: Keys, txn: Any, job: str, run: str, root: str) -> dict[str, Any]:
    """Delete an earlier run of ``job`` (never the current one): its etcd record and commits (through
    ``txn``, the leader's fenced writes) and its run directory under ``root``. Returns what went."""
    check_name("job", job)
    check_run_id(run)
    current = store.get(keys.job(job))
    if current is not None and run_of(parsed(current, "job")) == run:
        raise ConfigError(f"run {run} is job {job!r}'s current run: only an earlier run can be deleted")
    kvs, _ = store.get_prefix(f"{keys.runs(job)}{run}/")
    path = Path(root) / job / run if root else None
    on_disk = path is not None and path.exists()
    if not kvs and not on_disk:
        raise ConfigError(f"job {job!r} has no earlier run {run}: `rallypoint status {job}` lists its runs")
    if path is not None and on_disk:
        within(Path(root), path, "run directory")
        try:
            newest = read_latest(Path(root) / job)
        except (OSError, JobFailed):
            newest = ""
        if newest == run:
            raise ConfigError(f"run {run} is the newest run on disk of job {job!r} (LATEST): resume it, or start a "
                              "new run first")
    txn([Delete(f"{keys.runs(job)}{run}/", prefix=True)])
    if path is not None and on_disk:
        shutil.rmtree(path)
    return {"job": job, "run": run, "etcd_keys": len(kvs), "run_dir": str(path) if on_disk else ""}


def prune(store: Store, keys: Keys, txn: Any, job: str, root: str, keep: int) -> list[str]:
    """Retention: delete the earlier runs of ``job`` beyond the newest ``keep`` (0: keep all)."""
    if keep <= 0:
        return []
    runs = old_runs(store, keys, job)
    gone = []
    for r in runs[:max(0, len(runs) - keep)]:
        delete_run(store, keys, txn, job, r["run"], root)
        gone.append(r["run"])
    return gone


CODE_DIR = "code"


def code_path(run_directory: Path, sha256: str) -> Path:
    """Where a run keeps its code bundle: ``<run>/code/<sha256>.zip``."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ConfigError(f"code bundle hash {sha256!r} is not a sha256 in hex")
    return run_directory / CODE_DIR / f"{sha256}.zip"


def check_checkpoint_root(spec: Any, root: str) -> None:
    """A submitted job with states needs a checkpoint root (its own ``checkpoint_dir`` or the coordinators'): its
    checkpoints carry recovery, suspend and its final state. Without one it is refused, not run without them.

    Raises:
        ConfigError: the job has states and ``root`` is empty.
    """
    if not root and spec.states:
        raise ConfigError("it has states, whose checkpoints (recovery, suspend, its final state) need a checkpoint "
                          "directory, and the coordinators were started without one: start them with "
                          "--checkpoint-dir ROOT (a folder every worker reaches); nothing was started")


def check_code(spec: Any) -> None:
    """A submitted spec's code bundle: its bytes hash to its sha256, and a job with host sources has one.

    Raises:
        ConfigError: naming what is wrong.
    """
    hosts = [n.name for n in spec.nodes if n.HasField("host_source")]
    if hosts and not spec.code.sha256:
        raise ConfigError(f"host sources {hosts} need the job's code bundle, and the submit carries none")
    if spec.code.zip:
        got = hashlib.sha256(spec.code.zip).hexdigest()
        if got != spec.code.sha256:
            raise ConfigError(f"the code bundle's bytes hash to {got}, not to the {spec.code.sha256} it names: "
                              "it was damaged on the way; submit again")
    elif spec.code.sha256:
        raise ConfigError("the submit names a code bundle but carries no bytes")
    if spec.code.sha256:
        code_path(Path("."), spec.code.sha256)  # a hash that is a file name


def keep_code(rd: Path, spec: Any) -> None:
    """Write a submitted spec's code bundle into its run directory (once per hash; a file written
    whole or not at all) and drop its bytes from ``spec``: the spec recorded keeps the hash."""
    if not spec.code.zip:
        return
    path = code_path(rd, spec.code.sha256)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(spec.code.zip)
        os.replace(tmp, path)
    spec.code.ClearField("zip")


def start_run(spec: Any, store: Store, keys: Keys, txn: Any, root: Path | None, keep_runs: int,
              log: Any, *, now: float) -> tuple[str, Path | None, str]:
    """A new run of ``spec.job`` (the executor's start when it neither resumes nor adopts): the previous
    run's record and commits move under its run id (``txn``: the leader's fenced writes), the run
    directory is made with the spec it runs, and retention (``keep_runs``) deletes the oldest earlier
    runs; ``now``: the wall time, from the job's clock. Returns the run id and directory (None: no checkpoint
    root)."""
    run = new_run_id(now)
    for ops in archive_ops(keys, previous_run(store, keys, spec.job, None), now):
        txn(ops)
    rd, spec_sha256 = None, ""
    if root is not None:
        rd = run_dir(root, spec.job, create=True, run=run)
        keep_code(rd, spec)
        saved = type(spec)()
        saved.CopyFrom(spec)
        saved.ClearField("new_run")  # resuming or adopting it continues this run
        spec_sha256 = write_spec(rd, saved.SerializeToString())  # kept in the job record (run_files.py)
    try:
        gone = prune(store, keys, txn, spec.job, str(root or ""), keep_runs)
    except (RallypointError, OSError) as exc:  # retention must not keep the job from running
        log.warning("job.retention_failed", error=str(exc))
    else:
        if gone:
            log.info("job.runs_deleted", runs=gone, keep_runs=keep_runs)
    return run, rd, spec_sha256
