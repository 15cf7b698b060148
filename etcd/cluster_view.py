"""Reading the cluster's records (:mod:`rallypoint.etcd.cluster_records`) from etcd at one revision."""

from __future__ import annotations

from rallypoint.etcd.cluster_records import ClusterSnapshot, Holder, WorkerInfo, WorkerSnapshot
from typing import Any

from rallypoint.etcd.keys import Keys
from rallypoint.etcd.records import Fields, key_index, key_parts, skip_bad
from rallypoint.etcd.store import Get, KeyValue, Store

MAX_BY = 64  # characters of a cordon's "by" kept (a longer one is cut: it is only shown)

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
        if (d := skip_bad(lambda kv=kv: _device(kv.key, keys.devices, "device"))) is not None:
            devices.setdefault(d[0], []).append(d[1])
    holders: dict[str, dict[int, Holder]] = {}
    for kv in leases_kv:
        if (h := skip_bad(lambda kv=kv: (_device(kv.key, keys.leases, "holder"), Holder.from_json(kv.value, kv.key)))):
            (w, idx), holder = h
            holders.setdefault(w, {})[idx] = holder
    by: dict[str, str] = {}
    for kv in cordon_kv:
        if (c := skip_bad(lambda kv=kv: key_parts(kv.key, keys.cordons, 1, "cordon")[0])):
            who = skip_bad(lambda kv=kv: Fields.of(kv, "cordon").raw.get("by"))
            by[c] = who[:MAX_BY] if isinstance(who, str) else ""
    cordoned = frozenset(by)
    workers = {}
    for kv in workers_kv:
        info = skip_bad(lambda kv=kv: WorkerInfo.from_kv(key_parts(kv.key, keys.workers, 1, "worker")[0], kv))
        if info is None:
            continue
        w = info.worker
        workers[w] = WorkerSnapshot(
            info=info,
            devices=tuple(sorted(devices.get(w, []))),
            holders=holders.get(w, {}),
            cordoned=w in cordoned,
            cordoned_by=by.get(w, ""),
        )
    lost = {}
    for kv in lost_kv:
        if (rec := skip_bad(lambda kv=kv: (key_parts(kv.key, keys.lost_workers, 1, "lost")[0],
                                           Fields.of(kv, "lost").raw))) is not None:
            lost[rec[0]] = rec[1]
    return ClusterSnapshot(revision=r.revision, workers=workers, cordoned=cordoned, lost=lost)


def _device(key: str, under: str, kind: str) -> tuple[str, int]:
    """``(worker, index)`` of a ``devices/<w>/<index>`` or ``leases/<w>/<index>`` key, or BadRecord."""
    w, idx = key_parts(key, under, 2, kind)
    return w, key_index(key, idx, kind)


def parse_job_records(kvs: list[KeyValue], keys: Keys) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The job records among ``kvs`` (a read of ``keys.jobs``), and the jobs whose record is not a JSON object
    (skipped, logged and counted: :mod:`rallypoint.etcd.records`).

    Checkpoint commits live below ``jobs/<job>/`` and are skipped.
    """
    records: dict[str, dict[str, Any]] = {}
    bad: list[str] = []
    for kv in kvs:
        name = kv.key[len(keys.jobs):]
        if not name or "/" in name:
            continue
        rec = skip_bad(lambda kv=kv: Fields.of(kv, "job").raw)
        if rec is None:
            bad.append(name)
        else:
            records[name] = rec
    return records, bad


def job_records(store: Store, keys: Keys) -> dict[str, dict[str, Any]]:
    """Every readable job record of the cluster, by job."""
    kvs, _rev = store.get_prefix(keys.jobs)
    return parse_job_records(kvs, keys)[0]
