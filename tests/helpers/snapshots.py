"""Cluster snapshots built by hand: workers with their devices, holders and state, for the remap policy
and the warm spares (tests/recovery/, tests/orchestrator/)."""

from __future__ import annotations

from collections.abc import Iterable

from rallypoint.etcd.cluster_view import ClusterSnapshot, Holder, WorkerInfo, WorkerSnapshot


def worker(name: str, devices: int = 4, *, held: Iterable[int] = (), cordoned: bool = False,
           state: str = "serving", incarnation: int = 100) -> WorkerSnapshot:
    info = WorkerInfo(worker=name, incarnation=incarnation, lease=0x10, address=f"{name}:1", pid=1, devices=devices,
                      state=state, record={"state": state})
    holders = {d: Holder(job="other", slice=f"s{d}", nonce=f"n{d}") for d in held}
    return WorkerSnapshot(info=info, devices=tuple(range(devices)), holders=holders, cordoned=cordoned)


def cluster(*workers: WorkerSnapshot, lost: dict | None = None) -> ClusterSnapshot:
    return ClusterSnapshot(revision=7, workers={w.info.worker: w for w in workers},
                           cordoned=frozenset(w.info.worker for w in workers if w.cordoned), lost=lost or {})
