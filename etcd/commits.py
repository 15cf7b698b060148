"""Checkpoint commits: the records that make a slice's checkpoint count.

A commit (job, slice, step, path, checksum, state names) is written to etcd at the worker's
own ``keys.worker_commit(worker, job, slice, step)`` by the worker that made the checkpoint,
only after Orbax finalized it (:mod:`rallypoint.workers.checkpoints.committer`), and counts
once the job's leader checked it and promoted it to ``keys.checkpoint(job, slice, step)``
(:mod:`rallypoint.orchestrator.job.promote`); a copy goes beside the
checkpoints (``<run>/commits/<slice>/<step:012d>.json``) for ``rallypoint resume``
on a cluster whose etcd was lost. The coordinator reads them to find the newest
consistent cut. Plain records and reads; no Orbax here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rallypoint.etcd.keys import Keys
from rallypoint.etcd.records import MAX_RECORD_BYTES, REQUIRED, BadRecord, Fields, skip_bad
from rallypoint.etcd.store import KeyValue, Store


@dataclass(frozen=True, slots=True)
class CheckpointCommit:
    """A checkpoint that counts: the state of ``slice_name`` after ``step``."""

    job: str
    slice_name: str
    step: int
    path: str
    checksum: str
    states: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["slice"] = d.pop("slice_name")
        d["states"] = list(self.states)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], key: str = "commit") -> CheckpointCommit:
        """The commit ``d`` (a record at ``key``, named in errors).

        Raises:
            BadRecord: a field missing or of the wrong type (:mod:`rallypoint.etcd.records`).
        """
        f = Fields(key, d, "commit")
        states = f.items("states")
        if not all(isinstance(s, str) for s in states):
            raise f.bad("states", "holds a value that is not a string")
        step = f.integer("step", REQUIRED)
        if step < 0:
            raise f.bad("step", f"is {step}, not a step")
        return cls(job=f.text("job", REQUIRED), slice_name=f.text("slice", REQUIRED), step=step,
                   path=f.text("path", REQUIRED), checksum=f.text("checksum", REQUIRED), states=tuple(states))

    @classmethod
    def from_kv(cls, kv: KeyValue) -> CheckpointCommit:
        """The commit record at ``kv``. Raises :class:`~rallypoint.etcd.records.BadRecord`."""
        return cls.from_json(Fields.of(kv, "commit").raw, kv.key)


def read_commits(store: Store, keys: Keys, job: str) -> dict[str, list[CheckpointCommit]]:
    """Every checkpoint commit of ``job`` in etcd: slice -> commits sorted by step.

    A promoted commit that names the worker that wrote it counts only while that worker's own
    commit (:meth:`Keys.worker_commit`) still names the same directory: a worker forgets its
    commit before its retention deletes the checkpoint, and it stops counting at once."""
    from rallypoint.etcd.store import Get  # noqa: PLC0415 - beside its one use

    r = store.txn([], [Get(keys.checkpoints(job), prefix=True), Get(keys.worker_commits_all, prefix=True)])
    kvs, own = r.reads
    mine = {kv.key: kv.value for kv in own}
    out: dict[str, list[CheckpointCommit]] = {}
    for kv in kvs:
        fields = skip_bad(lambda kv=kv: Fields.of(kv, "commit"))
        c = skip_bad(lambda kv=kv: CheckpointCommit.from_kv(kv)) if fields is not None else None
        if c is None:
            continue
        worker = fields.raw.get("worker")
        if isinstance(worker, str) and worker:
            src = mine.get(keys.worker_commit(worker, job, c.slice_name, c.step))
            if src is None or _path_of(src) != c.path:
                continue  # forgotten by its worker (or rewritten since): it no longer counts
        out.setdefault(c.slice_name, []).append(c)
    for commits in out.values():
        commits.sort(key=lambda c: c.step)
    return out


def read_worker_commits(store: Store, keys: Keys, worker: str, job: str) -> dict[str, list[CheckpointCommit]]:
    """The commits ``worker`` wrote for ``job`` at its own keys (promoted or not): slice -> commits sorted by step."""
    kvs, _ = store.get_prefix(f"{keys.worker_commits(worker)}{job}/")
    out: dict[str, list[CheckpointCommit]] = {}
    for kv in kvs:
        c = skip_bad(lambda kv=kv: CheckpointCommit.from_kv(kv))
        if c is not None:
            out.setdefault(c.slice_name, []).append(c)
    for commits in out.values():
        commits.sort(key=lambda c: c.step)
    return out


def _path_of(value: bytes) -> str | None:
    """The ``path`` of a worker's own commit record (None: not a commit record)."""
    try:
        path = Fields("commit", value, "commit").raw.get("path")
    except BadRecord:
        return None
    return path if isinstance(path, str) else None


def consistent_cut(commits: Mapping[str, Sequence[CheckpointCommit]], slices: Iterable[str], *,
                   before: int | None = None) -> int | None:
    """The newest step every slice in ``slices`` has committed (below ``before`` when
    given, to fall back past a cut that does not restore); None if there is none."""
    common: set[int] | None = None
    for s in slices:
        steps = {c.step for c in commits.get(s, ()) if before is None or c.step < before}
        common = steps if common is None else common & steps
    return max(common) if common else None


def commit_record_path(run_dir: Path, slice_name: str, step: int) -> Path:
    """Where the on-disk copy of a commit goes."""
    return run_dir / "commits" / slice_name / f"{step:012d}.json"


def read_commit_records(run_dir: Path) -> dict[str, list[CheckpointCommit]]:
    """The on-disk copies of a run's commits: slice -> commits sorted by step."""
    out: dict[str, list[CheckpointCommit]] = {}
    for path in sorted((run_dir / "commits").glob("*/*.json")):
        try:
            c = CheckpointCommit.from_json(Fields(str(path), path.read_bytes()[:MAX_RECORD_BYTES + 1], "commit").raw,
                                           str(path))
        except (OSError, ValueError):
            continue  # a half-written copy: the etcd commit is what counts
        out.setdefault(c.slice_name, []).append(c)
    for commits in out.values():
        commits.sort(key=lambda c: c.step)
    return out
