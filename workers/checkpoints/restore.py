"""Reading a slice's checkpoints back: a commit's step directory, whole, checked against its checksum.

:func:`restore_commit` reads the step directory a commit names with Orbax alone (whoever
wrote it: a slice on one worker or the members of a multi-host slice) and checks it against
the commit's checksum (:mod:`rallypoint.workers.checkpoints.checksums`); a path outside the
slice's checkpoint directory is refused unread (:func:`checkpoint_within`).
:func:`latest_committed` falls back to older commits past a corrupt one.

Orbax is imported where it is used, not with this module: a worker (and a fresh one replacing a lost one)
starts without its import and JAX's under it, about half its start, until a job loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rallypoint.basics.errors import ConfigError
from rallypoint.basics.logs import get_logger
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.etcd.keys import check_name
from rallypoint.workers.checkpoints.checksums import checksum_of, commit_binding
from rallypoint.workers.errors import CheckpointCorrupt

__all__ = ["LatestCommitted", "States", "checkpoint_within", "latest_committed", "metadata_tree", "restore_commit"]

States = dict[str, list[np.ndarray]]
"""A slice's states: state name -> its value as flat leaves (host arrays)."""


def metadata_tree(item_dir: Path) -> Any:
    """The Orbax metadata of a saved ``{state: [leaves]}`` item: each leaf's shape and dtype (and how it was split)."""
    import orbax.checkpoint as ocp  # where it is used: see the module docstring
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        meta = ckptr.metadata(item_dir)
    tree = getattr(meta, "item_metadata", meta)
    return getattr(tree, "tree", tree)


def _restore_dir(step_dir: Path) -> States:
    """Read one step directory with Orbax alone, whole, into host arrays: one written by a slice on one worker, or
    by the members of a multi-host slice (saved over devices this process does not have: Orbax restores that only
    into a target it is given, here host arrays of the saved dtypes and shapes, 64-bit ones included)."""
    import orbax.checkpoint as ocp  # where it is used: see the module docstring
    import jax

    target = jax.tree_util.tree_map(lambda m: np.empty(tuple(m.shape), np.dtype(m.dtype)),
                                    metadata_tree(step_dir / "default"))
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        tree = ckptr.restore(step_dir / "default", args=ocp.args.StandardRestore(target))
    return {name: [np.asarray(x) for x in leaves] for name, leaves in tree.items()}


def checkpoint_within(commit: CheckpointCommit, slice_dir: Path) -> Path:
    """The directory ``commit.path`` names, resolved, once it is checked to lie inside ``slice_dir``.

    A commit comes from etcd (or a commit record on disk): its path is refused when it is
    relative, has a ``..`` part, or resolves (symlinks followed) outside the slice's
    checkpoint directory. Raises :class:`CheckpointCorrupt` then, before anything is read.
    """
    def refuse(why: str) -> CheckpointCorrupt:
        get_logger("rallypoint.checkpoint", job=commit.job, slice=commit.slice_name).warning(
            "checkpoint.path_refused", step=commit.step, path=commit.path, slice_dir=str(slice_dir), reason=why)
        return CheckpointCorrupt(commit, None, f"its path {why}; a commit may only name a step directory "
                                               f"inside the slice's checkpoint directory {slice_dir}")

    try:
        check_name("slice", commit.slice_name)
    except ConfigError as e:
        raise refuse(f"is of an invalid slice name ({e})") from e
    p = Path(commit.path)
    if not p.is_absolute():
        raise refuse("is not absolute")
    if ".." in p.parts:
        raise refuse("has a '..' part")
    real, base = p.resolve(), Path(slice_dir).absolute().resolve()
    if real == base or not real.is_relative_to(base):
        raise refuse(f"resolves to {real}, outside {base}")
    return real


def restore_commit(commit: CheckpointCommit, slice_dir: Path | None = None) -> States:
    """The states a commit names, read from ``commit.path`` and checked against its checksum.

    With ``slice_dir`` (the slice's checkpoint directory; a worker restoring a commit
    always passes it), a path outside it is refused unread (:func:`checkpoint_within`).

    Raises :class:`CheckpointCorrupt` when the checkpoint cannot be read, its checksum
    differs, or its path is refused.
    """
    log = get_logger("rallypoint.checkpoint", job=commit.job, slice=commit.slice_name)
    step_dir = checkpoint_within(commit, slice_dir) if slice_dir is not None else Path(commit.path)
    try:
        states = _restore_dir(step_dir)
    except Exception as e:  # any failure to read is a corrupt checkpoint
        log.warning("checkpoint.corrupt", step=commit.step, path=commit.path, expected=commit.checksum,
                    actual=None, error=f"{type(e).__name__}: {e}")
        raise CheckpointCorrupt(commit, None, f"{type(e).__name__}: {e}") from e
    actual = checksum_of(states, commit.checksum, step_dir, commit_binding(commit))
    if actual != commit.checksum:
        log.warning("checkpoint.corrupt", step=commit.step, path=commit.path, expected=commit.checksum,
                    actual=actual)
        raise CheckpointCorrupt(commit, actual)
    return states


@dataclass
class LatestCommitted:
    """What :func:`latest_committed` found: the newest good commit and what it skipped."""

    commit: CheckpointCommit | None
    states: States | None
    skipped: list[tuple[CheckpointCommit, str]] = field(default_factory=list)


def latest_committed(commits: Iterable[CheckpointCommit], slice_dir: Path | None = None) -> LatestCommitted:
    """Restore the newest of one slice's ``commits`` that reads back with its checksum.

    Corrupt or unreadable ones (and, with ``slice_dir``, ones whose path lies outside
    it: :func:`checkpoint_within`) are skipped (logged ``checkpoint.corrupt``, listed in
    ``skipped`` with the reason), falling back to older commits; ``commit`` is None
    when none restores.
    """
    found = LatestCommitted(None, None)
    ordered = sorted(commits, key=lambda c: c.step, reverse=True)
    if len({(c.job, c.slice_name) for c in ordered}) > 1:
        raise ValueError("latest_committed takes the commits of one slice of one job")
    for c in ordered:
        try:
            found.states, found.commit = restore_commit(c, slice_dir), c
            return found
        except CheckpointCorrupt as e:
            found.skipped.append((c, str(e)))
    return found
