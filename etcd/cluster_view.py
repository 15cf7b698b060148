"""Reading the cluster's records (:mod:`rallypoint.etcd.cluster_records`) from etcd at one revision."""

from __future__ import annotations

from rallypoint.etcd.cluster_records import ClusterSnapshot, Holder, WorkerInfo, WorkerSnapshot
from rallypoint.etcd.keys import Keys
from typing import Any

from rallypoint.etcd.store import Get, KeyValue, Store

__all__ = ["ClusterSnapshot", "Holder", "WorkerInfo", "WorkerSnapshot", "job_records", "parse_job_records", "read_cluster"]


def read_cluster(store: Store, keys: Keys) -> ClusterSnapshot:
    """Read a consistent snapshot (one transaction, one revision)."""
    r = store.txn(
        [],
        [Get(keys.workers, prefix=True), Get(keys.devices, prefix=True), Get(keys.leases, prefix=True),
         Get(keys.cordons, prefix=True), Get(keys.lost_workers, prefix=True)],
    )
    workers_kv, devices_kv, leases_kv, cordon_kv, lost_kv = r.reads
    devices: dict[str, list[int]] = {}
    for kv in devices_kv:
        w, idx = keys.tail(kv.key, keys.devices)
        devices.setdefault(w, []).append(int(idx))
    holders: dict[str, dict[int, Holder]] = {}
    for kv in leases_kv:
        w, idx = keys.tail(kv.key, keys.leases)
        holders.setdefault(w, {})[int(idx)] = Holder.from_json(kv.value)
    cordoned = frozenset(keys.tail(kv.key, keys.cordons)[0] for kv in cordon_kv)
    workers = {}
    for kv in workers_kv:
        w = keys.tail(kv.key, keys.workers)[0]
        workers[w] = WorkerSnapshot(
            info=WorkerInfo.from_kv(w, kv),
            devices=tuple(sorted(devices.get(w, []))),
            holders=holders.get(w, {}),
            cordoned=w in cordoned,
        )
    lost = {keys.tail(kv.key, keys.lost_workers)[0]: kv.json() for kv in lost_kv}
    return ClusterSnapshot(revision=r.revision, workers=workers, cordoned=cordoned, lost=lost)


def parse_job_records(kvs: list[KeyValue], keys: Keys) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The job records among ``kvs`` (a read of ``keys.jobs``), and the jobs whose record is not JSON.

    Checkpoint commits live below ``jobs/<job>/`` and are skipped.
    """
    records: dict[str, dict[str, Any]] = {}
    bad: list[str] = []
    for kv in kvs:
        name = kv.key[len(keys.jobs):]
        if not name or "/" in name:
            continue
        try:
            records[name] = kv.json()
        except ValueError:
            bad.append(name)
    return records, bad


def job_records(store: Store, keys: Keys) -> dict[str, dict[str, Any]]:
    """Every readable job record of the cluster, by job."""
    kvs, _rev = store.get_prefix(keys.jobs)
    return parse_job_records(kvs, keys)[0]
