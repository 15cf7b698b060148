"""Where the cluster records each daemon's Prometheus endpoint (:mod:`rallypoint.basics.metrics_server`).

The address a daemon's metrics server got goes into its etcd record (``metrics_address``
in the worker record and in the coordinator record; the leader key carries it too);
:func:`read_metrics_targets` finds every target for ``rallypoint metrics``.
"""

from __future__ import annotations

from typing import Any

from rallypoint.etcd.keys import Keys
from rallypoint.etcd.records import Fields, parsed, skip_bad
from rallypoint.etcd.store import KeyValue, Store


def read_metrics_targets(store: Store, keys: Keys) -> list[dict[str, Any]]:
    """Every live process's metrics endpoint: ``{"role", "name", "address", "leader"}`` rows (workers and
    coordinators without one are left out: they run without ``--metrics-port``)."""
    leader = parsed(store.get(keys.leader), "leader")
    leader_id = leader.get("coordinator") if leader is not None else None
    rows: list[dict[str, Any]] = []
    kvs, _ = store.get_prefix(keys.coordinators)
    for kv in kvs:
        row = skip_bad(lambda kv=kv: _target(kv, keys.coordinators, "coordinator", "coordinator"))
        if row is not None and row["address"]:
            rows.append(dict(row, leader=row["name"] == leader_id))
    kvs, _ = store.get_prefix(keys.workers)
    for kv in kvs:
        row = skip_bad(lambda kv=kv: _target(kv, keys.workers, "worker", "worker"))
        if row is not None and row["address"]:
            rows.append(dict(row, leader=False))
    return sorted(rows, key=lambda r: (r["role"], r["name"]))


def _target(kv: KeyValue, under: str, role: str, name_field: str) -> dict[str, Any]:
    f = Fields.of(kv, role)
    return {"role": role, "name": f.text(name_field, kv.key[len(under):]), "address": f.text("metrics_address")}
