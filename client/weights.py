"""Weights out: a run's committed state as the user's own tree (``rallypoint export``, :func:`load_state`).

A run directory (``<checkpoint root>/<job>/<run id>/``, docs/checkpoints.md) holds each slice's
checkpoints as flat leaves, the commit records naming them (path and checksum) and the job spec
(``jobspec.pb``), whose ``StateProgram.tree`` records each state's tree in Orbax's layout
(:mod:`rallypoint.client.trees`). :func:`read_run` reads the states of one committed step, every
slice's checkpoint checked against its commit's checksum (a multi-host slice's shards too), and
puts the leaves back into their trees; :func:`export_run` writes them as a plain Orbax checkpoint
(``<out>/<step>/default/``, a ``CheckpointManager`` directory, with ``rallypoint-export.json``
beside it), readable by Orbax alone; :func:`load_state` reads either back.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from rallypoint.basics.errors import ConfigError, RallypointError
from rallypoint.client.trees import fill, paths, skeleton_from_structure

__all__ = ["EXPORT_FILE", "FORMAT", "RunState", "export_checksum", "export_run", "load_state", "read_run"]

EXPORT_FILE = "rallypoint-export.json"  # beside the step directory: what was exported, from where, its checksum
FORMAT = "rallypoint-export/1"
JOBSPEC_FILE = "jobspec.pb"  # as orchestrator/job/runs.py names it


@dataclass(frozen=True)
class RunState:
    """What :func:`read_run` read: the states of ``step`` as trees (``tree``: the one state, or name -> tree)."""

    job: str
    run: str
    step: int
    names: tuple[str, ...]
    tree: Any
    single: bool
    sources: dict[str, dict[str, Any]]  # slice -> the commit read (step, checksum, path)


def _spec(run_dir: Path) -> Any:
    from rallypoint.proto import rallypoint_pb2 as pb

    path = run_dir / JOBSPEC_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory with checkpoints (it has no {JOBSPEC_FILE}): give "
                          "<checkpoint root>/<job>/<run id>, or find the run with `rallypoint export JOB`")
    return pb.JobSpec.FromString(path.read_bytes())


def committed_steps(run_dir: Path, slices: Sequence[str]) -> tuple[list[int], dict[str, Any]]:
    """The steps every one of ``slices`` committed (on disk, ``<run>/commits/``), ascending, and the commits."""
    from rallypoint.etcd.commits import read_commit_records

    commits = read_commit_records(run_dir)
    common: set[int] | None = None
    for s in slices:
        steps = {c.step for c in commits.get(s, ())}
        common = steps if common is None else common & steps
    return sorted(common or ()), commits


def _read_slice(run_dir: Path, commit: Any) -> dict[str, list[np.ndarray]]:
    """A slice's commit read from its run directory and checked against its checksum. The step directory is
    the one the commit names (``<slice>/<writer>/<step>``), taken under ``run_dir``: a run directory that was
    moved or copied still reads; a path out of the slice's directory is refused unread."""
    from rallypoint.workers.checkpoints.restore import restore_commit
    from rallypoint.workers.errors import CheckpointError

    slice_dir = run_dir / commit.slice_name
    named = Path(commit.path)
    local = replace(commit, path=str((slice_dir / named.parent.name / named.name).absolute()))
    try:
        return restore_commit(local, slice_dir)
    except CheckpointError as e:
        raise RallypointError(f"slice {commit.slice_name!r} at step {commit.step} of run {run_dir.name}: {e}; "
                              "nothing was exported (another committed step may read: --step)") from None


def read_run(run_dir: Path | str, *, step: int | None = None, states: Sequence[str] | None = None) -> RunState:
    """The committed states of a run at ``step`` (None: the newest step every slice holding them committed), as
    the user's trees in Orbax's layout. ``states``: the state names to read (None: all; one name gives that
    tree alone, as does a job with one state). Raises ConfigError naming what is wrong and what to do."""
    run_dir = Path(run_dir).absolute()
    spec = _spec(run_dir)
    by_name = {st.name: st for st in spec.states}
    if not by_name:
        raise ConfigError(f"job {spec.job!r} has no state: there is nothing to export")
    names = list(states) if states else sorted(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ConfigError(f"job {spec.job!r} has no state {', '.join(map(repr, unknown))}; its states are "
                          f"{', '.join(sorted(by_name))}: pass one of them to --state")
    layouts = {n: by_name[n].tree or skeleton_from_structure(by_name[n].treedef) for n in names}
    missing = [n for n, layout in layouts.items() if not layout]
    if missing:
        raise ConfigError(f"run {run_dir.name} of job {spec.job!r} was submitted without the tree of state(s) "
                          f"{', '.join(missing)} (a client older than export; its structure text names no fields of "
                          "its NamedTuple or dataclass nodes): read its flat leaves as docs/checkpoints.md shows, or "
                          "run the job again")
    slices = sorted({by_name[n].slice for n in names})
    steps, commits = committed_steps(run_dir, slices)
    if not steps:
        raise ConfigError(f"run {run_dir.name} of job {spec.job!r} has no committed checkpoint of "
                          f"{'slice' if len(slices) == 1 else 'slices'} {', '.join(slices)} yet: wait for its first "
                          "commit (checkpoint_every), or check that it ran with a checkpoint directory")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"step {step} of run {run_dir.name} of job {spec.job!r} was never committed; its "
                          f"committed steps are {', '.join(map(str, steps))}: pass one of them to --step")
    chosen = {s: next(c for c in commits[s] if c.step == step) for s in slices}
    flat: dict[str, list[np.ndarray]] = {}
    for s, c in chosen.items():
        flat.update(_read_slice(run_dir, c))
    trees = {}
    for n in names:
        st = by_name[n]
        leaves = flat.get(n)
        if leaves is None or len(leaves) != st.leaves:
            got = "none" if leaves is None else len(leaves)
            raise RallypointError(f"the checkpoint of slice {st.slice!r} at step {step} holds {got} leaves of state "
                                  f"{n!r}, and the job spec says {st.leaves}: nothing was exported")
        trees[n] = fill(layouts[n], leaves)
    single = len(names) == 1
    return RunState(job=spec.job, run=run_dir.name, step=int(step), names=tuple(names),
                    tree=trees[names[0]] if single else trees, single=single,
                    sources={s: {"step": c.step, "checksum": c.checksum, "path": c.path} for s, c in chosen.items()})


def export_checksum(tree: Any) -> str:
    """``sha256:`` over a tree's leaves in path order: for each a JSON line (path, dtype, shape), then its bytes."""
    h = hashlib.sha256()
    for path, leaf in sorted(paths(tree), key=lambda pl: [str(k) for k in pl[0]]):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(json.dumps({"path": list(path), "dtype": a.dtype.name, "shape": list(a.shape)}).encode() + b"\n")
        h.update(a.reshape(-1).view(np.uint8).data)
    return "sha256:" + h.hexdigest()


def _check_out(out: Path, force: bool) -> None:
    """``--out``: a folder that is absent or empty (any, with ``force``), under a folder this user may write."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a folder (absent or empty)")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {out} exists and is not empty: give an empty or new folder, or --force to "
                          "replace what is in it")
    above = out.parent
    while not above.exists():
        above = above.parent
    if not above.is_dir() or not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {above} cannot be written by this user: give a folder you may write")


def export_run(run_dir: Path | str, out: Path | str, *, step: int | None = None, state: str | None = None,
               force: bool = False) -> dict[str, Any]:
    """Write a run's committed state (see :func:`read_run`) to ``out`` as a plain Orbax checkpoint:
    ``<out>/<step>/default/`` (``ocp.args.StandardSave`` of the tree) and ``<out>/rallypoint-export.json``.
    Written in a folder beside ``out`` and renamed into place: a refused or failed export leaves nothing.
    Returns the manifest."""
    import orbax.checkpoint as ocp

    out = Path(out).absolute()
    _check_out(out, force)
    got = read_run(run_dir, step=step, states=[state] if state else None)
    made = out.parent  # the first folder above --out this export makes (removed again if it fails)
    while not made.parent.exists():
        made = made.parent
    made = made if not made.exists() else None
    tmp = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    ok = False
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        mngr = ocp.CheckpointManager(tmp)
        try:
            mngr.save(got.step, args=ocp.args.StandardSave(got.tree))
            mngr.wait_until_finished()
        finally:
            mngr.close()
        manifest = {"format": FORMAT, "job": got.job, "run": got.run, "step": got.step, "states": list(got.names),
                    "tree": "the state's tree" if got.single else "{state name: its tree}",
                    "item": f"{got.step}/default", "checksum": export_checksum(got.tree), "sources": got.sources}
        (tmp / EXPORT_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        ok = True
    except OSError as e:
        raise ConfigError(f"--out {out} could not be written ({e.strerror or e}): give a folder you may write, "
                          "on a disk with room") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not ok and made is not None:
            shutil.rmtree(made, ignore_errors=True)
    return {**manifest, "out": str(out)}


# -- reading back ----------------------------------------------------------------------------------------


def _item_dir(path: Path, step: int | None) -> tuple[Path, dict[str, Any]]:
    """The Orbax item to read under an export (or any CheckpointManager) directory, a step directory or an item."""
    if (path / "_METADATA").is_file():  # an item folder itself
        return path, {}
    if (path / "default").is_dir():  # a step folder
        return path / "default", _manifest(path.parent, path.name)
    steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / "default").is_dir()) \
        if path.is_dir() else []
    if not steps:
        raise ConfigError(f"{path} holds no Orbax checkpoint (no <step>/default/) and is not a run directory "
                          "(no jobspec.pb): give an export's --out folder or a run directory")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"{path} has no step {step}; its steps are {', '.join(map(str, steps))}")
    return path / str(step) / "default", _manifest(path, str(step))


def _manifest(path: Path, step: str) -> dict[str, Any]:
    """An export's ``rallypoint-export.json`` when it is about ``step`` ({} when there is none)."""
    try:
        manifest = json.loads((path / EXPORT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) and str(manifest.get("step")) == step else {}


def _sharding_for(shardings: Any) -> Any:
    """A function path -> sharding from one sharding or a tree of them (the layout's or the user's own types)."""
    import jax

    if isinstance(shardings, jax.sharding.Sharding):
        return lambda path: shardings
    table = dict(paths(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))

    def of(path: tuple[Any, ...]) -> Any:
        if path not in table:
            raise ConfigError(f"shardings has no sharding for leaf {'/'.join(map(str, path)) or '(the root)'}: give "
                              "one per leaf of the state's tree, or one sharding for all")
        return table[path]
    return of


def _placed(tree: Any, shardings: Any) -> Any:
    import jax

    of = _sharding_for(shardings)
    flat, treedef = jax.tree_util.tree_flatten(tree)
    placed = [jax.device_put(leaf, of(path)) for (path, _), leaf in zip(paths(tree), flat, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, placed)


def load_state(path: str | os.PathLike[str], *, shardings: Any = None, step: int | None = None) -> Any:
    """A state exported by ``rallypoint export`` (its ``--out`` folder, a step folder in it, or any plain Orbax
    ``StandardSave`` item), or read straight from a job's run directory (``<checkpoint root>/<job>/<run id>``:
    every state, the newest committed step by default), as its tree in Orbax's layout (docs/checkpoints.md).

    ``shardings``: None gives NumPy arrays; one ``jax.sharding.Sharding`` puts every leaf on it; a tree of them
    (the state's layout, or the user's own tree of the same paths) one per leaf. ``step``: the step to read
    (None: the newest). An export's checksum (``rallypoint-export.json``) is checked when NumPy arrays are read.
    """
    import jax

    p = Path(path).absolute()
    if (p / JOBSPEC_FILE).is_file():
        tree = read_run(p, step=step).tree
        return tree if shardings is None else _placed(tree, shardings)
    import orbax.checkpoint as ocp

    from rallypoint.workers.checkpoints.restore import metadata_tree

    item, manifest = _item_dir(p, step)
    meta = metadata_tree(item)
    if shardings is None:
        target = jax.tree_util.tree_map(lambda m: np.empty(tuple(m.shape), np.dtype(m.dtype)), meta)
    else:
        of = _sharding_for(shardings)
        flat, treedef = jax.tree_util.tree_flatten(meta)
        target = jax.tree_util.tree_unflatten(treedef, [
            jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype), sharding=of(path))
            for (path, _), m in zip(paths(meta), flat, strict=True)])
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        tree = ckptr.restore(item, args=ocp.args.StandardRestore(target))
    if shardings is None:
        tree = jax.tree_util.tree_map(np.asarray, tree)
        want = manifest.get("checksum")
        if want and export_checksum(tree) != want:
            raise RallypointError(f"the export at {item} does not match its checksum in {EXPORT_FILE} ({want}): its "
                                  "files were changed or damaged; export it again")
    return tree


def describe(manifest: Mapping[str, Any]) -> str:
    """The line ``rallypoint export`` prints."""
    what = manifest["states"][0] if len(manifest["states"]) == 1 else f"states {', '.join(manifest['states'])}"
    return (f"{manifest['job']}: {what} at step {manifest['step']} of run {manifest['run']} exported to "
            f"{manifest['out']} (Orbax: CheckpointManager step {manifest['step']}, item 'default'; "
            f"rallypoint.client.load_state reads it)")
