"""Where the cluster records each daemon's Prometheus endpoint (:mod:`rallypoint.basics.metrics_server`).

The address a daemon's metrics server got goes into its etcd record (``metrics_address``
in the worker record and in the coordinator record; the leader key carries it too);
:func:`read_metrics_targets` finds every target for ``rallypoint metrics``.
"""

from __future__ import annotations

from typing import Any

from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import Store


def read_metrics_targets(store: Store, keys: Keys) -> list[dict[str, Any]]:
    """Every live process's metrics endpoint: ``{"role", "name", "address", "leader"}`` rows (workers and
    coordinators without one are left out: they run without ``--metrics-port``)."""
    leader = store.get(keys.leader)
    leader_id = leader.json().get("coordinator") if leader is not None else None
    rows: list[dict[str, Any]] = []
    kvs, _ = store.get_prefix(keys.coordinators)
    for kv in kvs:
        rec = kv.json()
        if rec.get("metrics_address"):
            name = rec.get("coordinator", kv.key[len(keys.coordinators):])
            rows.append({"role": "coordinator", "name": name, "address": rec["metrics_address"],
                         "leader": name == leader_id})
    kvs, _ = store.get_prefix(keys.workers)
    for kv in kvs:
        rec = kv.json()
        if rec.get("metrics_address"):
            rows.append({"role": "worker", "name": rec.get("worker", kv.key[len(keys.workers):]),
                         "address": rec["metrics_address"], "leader": False})
    return sorted(rows, key=lambda r: (r["role"], r["name"]))
