"""What a checkpoint's commit says its bytes are: one checksum over a slice's states, of either of two kinds.

* ``sha256b:<hex>`` (:func:`state_checksum` with ``bind``): over the checkpoint's identity
  ``(job, run, slice, step)`` (:func:`binding`), then every state's leaves, whole, in name
  order: what a slice on one worker commits, computed from the host copy it saves. A commit
  that names another step's (or slice's, job's, run's) directory and checksum does not
  verify: the restorer binds the commit's own job, slice and step and the run its path lies in.
  ``sha256:<hex>`` is the same without the identity (checkpoints of earlier versions: they
  still restore, but a leader promotes no new commit of that kind).
* ``sha256-shards:<hex>`` (:func:`shards_checksum`): what a multi-host slice commits, whose
  members each save only their own shards and no process ever holds a whole leaf
  (docs/multihost.md). Each member digests the shards it holds the first replica of; the
  list of ``{state, leaf, index, dtype, shape, sha256}`` (together they cover every leaf
  once) is written beside the checkpoint as ``shards.json``, and the checksum is over that
  list in a canonical order. The list, not the checksum, depends on how the leaves were
  split; :func:`checksum_of` checks either kind against whole leaves read back in one
  process, whatever its layout, so a gang's checkpoint restores anywhere.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SHARDED = "sha256-shards:"
SHARDS_FILE = "shards.json"  # the digests of a sharded save, in its step directory


BOUND = "sha256b:"


def run_of(path: str | Path, slice_name: str) -> str:
    """The run a checkpoint's path lies in: the directory above its slice's (``<run>/<slice>/<writer>/<step>``);
    "" when the path names no such directory."""
    parts = Path(path).parts
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] == slice_name:
            return parts[i - 1]
    return ""


def binding(job: str, run: str, slice_name: str, step: int) -> tuple[str, str, str, int]:
    """The identity a checkpoint's checksum binds."""
    return (str(job), str(run), str(slice_name), int(step))


def commit_binding(commit: Any) -> tuple[str, str, str, int]:
    """The identity a commit (job, slice_name, step, path) claims for its checkpoint."""
    return binding(commit.job, run_of(commit.path, commit.slice_name), commit.slice_name, commit.step)


def state_checksum(states: Mapping[str, Sequence[Any]], bind: tuple[str, str, str, int] | None = None) -> str:
    """``sha256:<hex>`` over the states in name order: for each leaf a JSON header
    ``{"state", "leaf", "dtype", "shape"}`` and a newline, then its C-order bytes. With ``bind``
    (:func:`binding`): ``sha256b:<hex>``, the identity's JSON line first."""
    h = hashlib.sha256()
    if bind is not None:
        h.update(json.dumps({"job": bind[0], "run": bind[1], "slice": bind[2], "step": bind[3]}).encode() + b"\n")
    for name in sorted(states):
        h.update(json.dumps({"state": name, "leaves": len(states[name])}).encode() + b"\n")
        for i, leaf in enumerate(states[name]):
            a = np.ascontiguousarray(leaf)
            h.update(json.dumps({"state": name, "leaf": i, "dtype": a.dtype.name,
                                 "shape": list(a.shape)}).encode() + b"\n")
            h.update(a.reshape(-1).view(np.uint8).data)
    return (BOUND if bind is not None else "sha256:") + h.hexdigest()


def shard_entries(rows: Iterable[Sequence[Any]]) -> list[dict[str, Any]]:
    """The members' digest rows (``[state, leaf, index, dtype, shape, sha256]``) as a sharded save's listing,
    in its canonical order."""
    entries = [{"state": str(s), "leaf": int(i), "index": [[int(a), int(b)] for a, b in ix],
                "dtype": np.dtype(d).name, "shape": [int(n) for n in shape], "sha256": str(h)}
               for s, i, ix, d, shape, h in rows]
    return sorted(entries, key=lambda e: (e["state"], e["leaf"], e["index"]))


def shards_checksum(entries: Sequence[Mapping[str, Any]]) -> str:
    """``sha256-shards:<hex>`` over a sharded save's listing (:func:`shard_entries`)."""
    canon = json.dumps(sorted(entries, key=lambda e: (e["state"], e["leaf"], e["index"])), sort_keys=True,
                       separators=(",", ":"))
    return SHARDED + hashlib.sha256(canon.encode()).hexdigest()


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data).hexdigest()


def read_listing(step_dir: Path) -> list[dict[str, Any]]:
    """The ``shards.json`` of a sharded save (OSError, ValueError: missing or unreadable)."""
    listing = json.loads((Path(step_dir) / SHARDS_FILE).read_text())
    if not isinstance(listing, list):
        raise ValueError(f"{SHARDS_FILE} holds no list")
    return listing


def checksum_of(states: Mapping[str, Sequence[Any]], committed: str, step_dir: Path | None,
                bind: tuple[str, str, str, int] | None = None) -> str:
    """The checksum of ``states`` (whole leaves) of the kind ``committed`` is: equal to it iff they are the
    bytes that were saved. A sharded one re-digests the leaves split as its ``shards.json`` lists them,
    and is something else when that file is missing or does not cover each leaf exactly once. A bound one
    (``sha256b:``) binds ``bind``, the identity the caller expects (:func:`commit_binding`)."""
    if committed.startswith(BOUND):
        return state_checksum(states, bind) if bind is not None else "none: no identity to bind"
    if not committed.startswith(SHARDED):
        return state_checksum(states)
    try:
        listing = read_listing(step_dir) if step_dir is not None else []
    except (OSError, ValueError) as e:
        return f"none: {SHARDS_FILE} unreadable ({type(e).__name__})"
    if shards_checksum(listing) != committed:
        return f"none: {SHARDS_FILE} does not match the commit"
    again, covered = [], dict.fromkeys(((name, i) for name, leaves in states.items() for i in range(len(leaves))), 0)
    for e in listing:
        try:
            a = np.asarray(states[e["state"]][e["leaf"]])
            part = a[tuple(slice(x, y) for x, y in e["index"])]
        except (KeyError, IndexError, TypeError):
            return f"none: no leaf {e.get('state')}[{e.get('leaf')}] to match its shard"
        covered[(e["state"], e["leaf"])] += part.size
        again.append(dict(e, dtype=a.dtype.name, shape=list(a.shape), sha256=digest(part)))
    short = [f"{s}[{i}]" for (s, i), n in covered.items() if n != np.asarray(states[s][i]).size]
    if short:
        return f"none: the shards do not cover {short} exactly once"
    return shards_checksum(again)
