"""The Prometheus endpoint every daemon may serve.

Each coordinator and worker serves its own :class:`prometheus_client.CollectorRegistry`
(never the process-global default, so several in one test process do not clash) over
prometheus_client's HTTP server on ``--metrics-port`` (0: a free port). The address it
got goes into the process's etcd record, where
:func:`rallypoint.etcd.metrics_targets.read_metrics_targets` finds it. The metrics
themselves are in ``docs/metrics.md``; the collectors in ``orchestrator/metrics.py`` and
``workers/metrics.py``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


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
