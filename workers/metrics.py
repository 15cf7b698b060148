"""The worker's Prometheus metrics (``docs/metrics.md`` lists each one).

:class:`WorkerMetrics` owns a private :class:`~prometheus_client.CollectorRegistry`, serves
it (:class:`rallypoint.basics.metrics_server.MetricsServer`) and installs this process's
:class:`~rallypoint.workers.meter.WorkerMeter` (what the runtime counts as it works:
instances, checkpoint times, transferred bytes). At each scrape a collector adds what the
daemon holds now: its state and incarnation, the jobs loaded, each job's output log
(bytes in memory and spilled to disk) and the in-memory checkpoint tier's bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rallypoint.basics.metrics_server import MetricsServer
from rallypoint.etcd.records import bad_records_metric
from rallypoint.workers import meter
from rallypoint.workers.meter import JOB_LABEL, WorkerMeter
from rallypoint.workers.platform import memory_stats

STATES = ("starting", "registering", "serving", "fenced", "stopping", "stopped")  # workers.daemon.WorkerState


class WorkerMetrics:
    """The Prometheus endpoint of one worker daemon (see the module doc).

    Args:
        daemon: the :class:`~rallypoint.workers.daemon.WorkerDaemon` (its ``state``,
            ``incarnation`` and ``runtime`` are read at each scrape).
        host, port: where the endpoint listens (port 0: a free one).
    """

    def __init__(self, daemon: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.daemon = daemon
        self.registry = CollectorRegistry(auto_describe=False)
        self.meter = WorkerMeter(self.registry)
        self.registry.register(_WorkerCollector(daemon))
        meter.install(self.meter)
        self.server = MetricsServer(self.registry, host=host, port=port)
        self.address = self.server.address

    def close(self) -> None:
        self.server.close()
        if meter.current() is self.meter:
            meter.install(None)


class _WorkerCollector(Collector):
    def __init__(self, daemon: Any) -> None:
        self.d = daemon

    def collect(self) -> Iterator[Metric]:
        d = self.d
        g = GaugeMetricFamily("rallypoint_worker_state", "1 for the worker daemon's current state", labels=["state"])
        for s in STATES:
            g.add_metric([s], 1.0 if d.state.value == s else 0.0)
        yield g
        g = GaugeMetricFamily("rallypoint_worker_incarnation", "The worker's current incarnation (0: not registered)")
        g.add_metric([], float(d.incarnation))
        yield g
        rt = d.runtime
        runtimes = rt.runtimes() if rt is not None else []
        g = GaugeMetricFamily("rallypoint_worker_jobs_loaded", "Jobs loaded on this worker now")
        g.add_metric([], float(len(runtimes)))
        yield g
        g = GaugeMetricFamily("rallypoint_worker_output_log_bytes", "Bytes of each loaded job's output log, held in "
                              "memory (device: the part not copied off the device yet) or spilled to disk", labels=[JOB_LABEL, "where"])
        for r in runtimes:
            g.add_metric([r.job, "memory"], float(r.outlog.memory_bytes))
            g.add_metric([r.job, "device"], float(r.outlog.device_bytes))  # of memory: not copied off yet
            g.add_metric([r.job, "spilled"], float(r.outlog.spilled_bytes))
        yield g
        if rt is not None:
            g = GaugeMetricFamily("rallypoint_worker_replica_bytes", "Bytes of the checkpoint copies this worker holds "
                                  "in memory for other workers (the in-memory tier)")
            g.add_metric([], float(rt.replicas.store.nbytes))
            yield g
        yield from device_memory_metrics(d)
        yield bad_records_metric()
        dp = getattr(d, "dataplane", None)
        if dp is not None:
            c = CounterMetricFamily("rallypoint_worker_dataplane_refused_connections", "Data-plane connections closed "
                                    "at once: over the limit of connections not yet authenticated, or of all "
                                    "connections (workers/dataplane.py)")
            c.add_metric([], float(dp.refused_connections))
            yield c
            c = CounterMetricFamily("rallypoint_worker_dataplane_accept_errors", "Errors of the data plane's accept "
                                    "loop, which logs each and goes on")
            c.add_metric([], float(dp.accept_errors))
            yield c


def device_memory_metrics(daemon: Any) -> Iterator[Metric]:
    """Each local device's memory in use and its peak (``memory_stats()``; docs/metrics.md), and its limit.

    Platforms that keep no such statistics (CPU) give no samples: nothing is made up."""
    devices = daemon.jax_devices() if daemon.devices else []  # listed at start: JAX's backend is up
    stats = [(i, memory_stats(dev)) for i, dev in enumerate(devices)]
    for name, key, what in (("rallypoint_worker_device_memory_in_use_bytes", "bytes_in_use", "in use now"),
                            ("rallypoint_worker_device_memory_peak_bytes", "peak_bytes_in_use",
                             "at its peak since the worker started"),
                            ("rallypoint_worker_device_memory_limit_bytes", "bytes_limit", "the allocator may use")):
        g = GaugeMetricFamily(name, f"Bytes of each local device's memory {what} (absent where the platform "
                              "reports none, as on CPU)", labels=["device"])
        for i, st in stats:
            if key in st:
                g.add_metric([str(i)], float(st[key]))
        yield g
