"""The in-memory checkpoint tier for multi-host slices: each member's shards in two other processes' memory.

A one-worker slice's commit is copied whole to a peer's memory (:mod:`rallypoint.workers.checkpoints.replicas`).
A multi-host slice's states are never whole on any host (docs/multihost.md), so its members copy
their own shards instead: member ``j``'s shards of a commit are the slice's **part** ``j``
(:func:`~rallypoint.recovery.replicas.part_name`, ``<slice>#<j>``), stored in the same
:class:`~rallypoint.workers.checkpoints.replicas.ReplicaStore` as any copy, on two workers:

* member ``j``'s own worker daemon, whose memory outlives the member process (a group's
  processes die together when one member is lost);
* the holder the coordinator plans for the part (``LoadJobRequest.replica_targets``:
  :func:`~rallypoint.recovery.replicas.plan_replicas` over the parts, on another worker).

A single lost host therefore leaves a copy of every part. The members' side is
:mod:`rallypoint.workers.gang.member_parts`. The flow:

* **Save** (``save`` with ``keep``): each member keeps a host copy of every shard it holds
  (one per index: the replicas of a replicated leaf are one shard), keyed
  ``[state, leaf, index]``.
* **After the commit** (:meth:`Parts.stash`, asked by the lead's commit thread): each member
  pushes its kept shards to its two holders (``PushReplica``), on a thread of its own, so the
  slice runs meanwhile; a save that never commits is never pushed.
* **Restore** (:func:`restore_from_parts`, before the disk): the lead reads the commit's
  ``shards.json`` (small) and checks it against the commit's ``sha256-shards:`` checksum; each
  member of the new gang fetches its part from the sources the coordinator named
  (``FetchReplica``, the old member's worker and the part's holder), checks every shard it needs
  against the listing's digest of its index, and builds its values from them. Any member that
  cannot (no source answers, a shard missing, a digest that differs, a new gang split otherwise)
  makes the whole slice read the disk: a copy is trusted only through the commit, never through
  its holder's word.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rallypoint.basics.logs import get_logger
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.replicas import part_name
from rallypoint.workers.checkpoints.checksums import SHARDED, read_listing, shards_checksum
from rallypoint.workers.gang.lead import GangSlice, GroupSharding, GroupValue
from rallypoint.workers.gang.member_parts import peer_json
from rallypoint.workers.gang.group import GroupError


def part_targets(gang: GangSlice, member: int, replicator: Any) -> list[pb.ReplicaPeer]:
    """Where member ``member``'s part of ``gang``'s commits goes: its own worker, then the part's planned holder
    (``replicator``'s target, if any)."""
    m, name = gang.members[member], part_name(gang.name, member)
    out = [pb.ReplicaPeer(slice=name, worker_id=m.worker_id, address=m.address, incarnation=m.incarnation)]
    held = replicator.target(name) if replicator is not None else None
    if held is not None and held.worker_id != m.worker_id:
        out.append(held)
    return out


def restore_from_parts(commit: CheckpointCommit, step_dir: Path, gang: GangSlice,
                       layouts: Mapping[str, Sequence[GroupSharding]], sources: Sequence[Sequence[pb.ReplicaPeer]], *,
                       cluster: str) -> dict[str, list[GroupValue]] | None:
    """The states ``commit`` names, built by the members of ``gang`` from copies of their parts in memory
    (``sources[j]``: where member ``j``'s part may be), or None (logged why): the caller reads the disk.

    Raises GroupLost: a member was lost meanwhile (a loss of the slice, not of the copies)."""
    log = get_logger("rallypoint.replicas", job=commit.job, slice=commit.slice_name)
    t0 = time.perf_counter()
    if not commit.checksum.startswith(SHARDED):
        return None  # saved whole, by a slice on one worker: its copy is the whole slice's, not parts
    try:
        listing = read_listing(step_dir)
    except (OSError, ValueError) as exc:
        log.info("replica.unavailable", step=commit.step, reason=f"its shard listing is unreadable: {exc}")
        return None
    if shards_checksum(listing) != commit.checksum:
        log.warning("replica.unavailable", step=commit.step, reason="its shard listing is not the one committed")
        return None
    avals: dict[str, dict[int, tuple[str, list[int]]]] = {}
    for e in listing:
        avals.setdefault(str(e["state"]), {})[int(e["leaf"])] = (str(e["dtype"]), list(e["shape"]))
    if set(avals) != set(layouts) or any(sorted(avals[s]) != list(range(len(layouts[s]))) for s in layouts):
        log.info("replica.unavailable", step=commit.step, reason="the commit's states are not the slice's")
        return None
    values = {s: [gang.value(*avals[s][i]) for i in range(len(layouts[s]))] for s in layouts}
    tree = {s: [{"value": v.name, "shape": list(v.shape), "dtype": v.dtype.name, **lay.layout}
                for v, lay in zip(values[s], layouts[s], strict=True)] for s in layouts}
    header = {"op": "restore_parts", "tree": tree, "listing": listing, "job": commit.job, "step": commit.step,
              "checksum": commit.checksum, "cluster": cluster}
    extra = [{"part": part_name(commit.slice_name, j), "sources": [peer_json(p) for p in sources[j]]}
             for j in range(len(gang.group.members))]
    names = [v.name for leaves in values.values() for v in leaves]
    try:
        answers = gang.group.request(header, extra=extra)
    except GroupError as exc:
        gang.group.free(names)
        log.warning("replica.unavailable", step=commit.step, reason=str(exc))
        return None
    missing = [f"member {j}: {h.get('why')}" for j, (h, _) in enumerate(answers) if not h.get("ok")]
    if missing:
        gang.group.free(names)
        log.info("replica.unavailable", step=commit.step, reason="; ".join(missing))
        return None
    log.info("checkpoint.restored_on_group", step=commit.step, checked="shards", tier="memory",
             members=len(answers), holders=[h.get("holder") for h, _ in answers],
             restore_s=round(time.perf_counter() - t0, 4),
             bytes=sum(v.nbytes for leaves in values.values() for v in leaves))
    return values
