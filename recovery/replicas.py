"""Where each slice's committed checkpoints are copied in host memory: a pure policy.

The in-memory checkpoint tier (``docs/checkpoints.md``) keeps a copy of every slice's
newest commits in the host memory of **another** worker, so that a restore after the
slice's own worker was lost reads memory, not disk. :func:`plan_replicas` picks that
**holder** for every slice from plain data (the placement, the spare workers):

* the job's workers form a ring, ordered by the smallest slice name each one holds;
  every slice of a worker is held by the next worker in the ring, so each worker holds
  the copies of one other worker and no worker holds its own;
* a job on a single worker has no peer: its slices are held by a spare (the first one
  in name order), or by nobody when there is no spare (disk only).

The ring order depends only on slice names, so when a lost worker's slices move to
another worker, that worker takes its place in the ring and the holders of the other
slices do not change.

A multi-host slice's states are never whole on one worker: each member's shards are its
**part** (:func:`part_name`), placed on that member's worker (:func:`with_parts`) and
planned as a slice of its own, so a part's holder is never its member's worker. (The
member's own worker keeps a copy too: ``workers/gang/replicas.py``.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def part_name(slice_name: str, member: int) -> str:
    """The name member ``member``'s shards of multi-host slice ``slice_name`` are copied under."""
    return f"{slice_name}#{member}"


def with_parts(placement: Mapping[str, str], gangs: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """``placement`` (``{slice: worker}``) with the parts of each multi-host slice of ``gangs`` (``{slice: its
    members' workers, in process order}``) on their members' workers."""
    out = dict(placement)
    for s, members in gangs.items():
        out.update({part_name(s, j): w for j, w in enumerate(members)})
    return out


def worker_ring(placement: Mapping[str, str]) -> list[str]:
    """The job's workers in ring order: by the smallest slice name each holds."""
    first: dict[str, str] = {}
    for slice_name, worker in placement.items():
        if worker not in first or slice_name < first[worker]:
            first[worker] = slice_name
    return sorted(first, key=lambda w: (first[w], w))


def plan_replicas(placement: Mapping[str, str], spares: Iterable[str] = ()) -> dict[str, str]:
    """``{slice: holder worker}`` for every slice of ``placement`` (``{slice: worker}``) that can have one.

    The holder is never the slice's own worker. A slice is left out only when the job runs
    on one worker and no spare (a worker not in ``placement``) exists.
    """
    ring = worker_ring(placement)
    if len(ring) >= 2:
        nxt = {w: ring[(i + 1) % len(ring)] for i, w in enumerate(ring)}
        return {s: nxt[w] for s, w in placement.items()}
    others = sorted(set(spares) - set(ring))
    if not ring or not others:
        return {}
    return {s: others[0] for s in placement}


def replica_sources(previous: Mapping[str, str], current: Mapping[str, str], restoring: Iterable[str],
                    alive: Iterable[str]) -> dict[str, list[str]]:
    """Where a copy of each restoring slice's commit may be, nearest first: its holder under
    the plan in force when the commit was made (``previous``), then under the plan now
    (``current``; the same worker unless slices moved), leaving out workers not ``alive``
    (a lost holder would only cost a timeout). Slices with no candidate are left out."""
    up = set(alive)
    out: dict[str, list[str]] = {}
    for s in restoring:
        cands = [h for h in (previous.get(s), current.get(s)) if h is not None and h in up]
        if cands:
            out[s] = list(dict.fromkeys(cands))
    return out
