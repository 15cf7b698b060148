"""The Prometheus endpoint every daemon may serve, and where the cluster records it.

Each coordinator and worker serves its own :class:`prometheus_client.CollectorRegistry`
(never the process-global default, so several in one test process do not clash) over
prometheus_client's HTTP server on ``--metrics-port`` (0: a free port). The address it
got goes into the process's etcd record (``metrics_address`` in the worker record and
in the coordinator record; the leader key carries it too), where
:func:`read_metrics_targets` finds every target for ``rallypoint metrics``. The metrics
themselves are in ``docs/metrics.md``; the collectors in ``orchestrator/metrics.py`` and
``workers/metrics.py``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import Store


class MetricsServer:
    """prometheus_client's HTTP server for one registry, in a daemon thread, until :meth:`close`."""

    def __init__(self, registry: CollectorRegistry, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.registry = registry
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        bound_host, bound_port = self._httpd.server_address[:2]
        self.address = f"{host or bound_host}:{bound_port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2.0)


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
