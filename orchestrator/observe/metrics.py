"""The coordinator's Prometheus metrics (``docs/metrics.md`` lists each one).

A :class:`CoordinatorMetrics` owns a private :class:`~prometheus_client.CollectorRegistry`
and serves it (:class:`rallypoint.basics.metrics_server.MetricsServer`). Nothing is counted
twice: one collector reads, at each scrape,

* the cluster from etcd at one revision (leader only, so that summing over coordinators
  counts each worker once): workers by state, devices held and free, device leases by job;
* every job executor this coordinator started (the job service tells it,
  :meth:`CoordinatorMetrics.job_started`; ended ones are kept, newest ``KEEP_JOBS``):
  the job's state, steps, steps/s, step time per slice, recoveries and their phases,
  drains, replays, and the goodput buckets of :mod:`rallypoint.orchestrator.job.goodput`.

Job metrics are labelled ``job_name`` (not ``job``, which Prometheus sets to the scrape
job). Their counters count what this coordinator's executor of the job did: a job adopted
by a new leader, or run again under the same name, starts again from 0 there (a counter
reset, which ``rate()`` and ``increase()`` handle).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.etcd.records import bad_records_metric
from rallypoint.basics.errors import StoreError
from rallypoint.basics.metrics_server import MetricsServer
from rallypoint.orchestrator.job.goodput import (COORDINATOR_BUCKETS, Histogram, goodput_buckets, goodput_ratio,
                                             histogram_of, phase_seconds, steps_per_s)
from rallypoint.orchestrator.job.recovery import PHASES
from rallypoint.orchestrator.job.state import JobState
from rallypoint.orchestrator.job.view import JobHandle, JobView

KEEP_JOBS = 64  # jobs whose metrics stay after they ended (the oldest go first)
WORKER_STATES = ("spare", "leased", "cordoned", "leaving", "lost")
JOB_LABEL = "job_name"


class CoordinatorMetrics:
    """The Prometheus endpoint of one coordinator (see the module doc).

    Args:
        coordinator: the :class:`~rallypoint.orchestrator.service.coordinator.Coordinator` (its
            ``election``, ``store`` and ``keys`` are read at each scrape).
        host, port: where the endpoint listens (port 0: a free one).
    """

    def __init__(self, coordinator: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.c = coordinator
        self._lock = threading.Lock()
        self._jobs: OrderedDict[str, JobHandle] = OrderedDict()  # job -> the newest executor of it here
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_CoordinatorCollector(self))
        self.server = MetricsServer(self.registry, host=host, port=port)
        self.address = self.server.address

    def job_started(self, job: str, executor: JobHandle) -> None:
        """An executor of ``job`` starts here (the job service calls it); each scrape reads its view."""
        with self._lock:
            self._jobs[job] = executor
            self._jobs.move_to_end(job)
            while len(self._jobs) > KEEP_JOBS:
                self._jobs.popitem(last=False)

    def executors(self) -> list[JobHandle]:
        with self._lock:
            return list(self._jobs.values())

    def close(self) -> None:
        self.server.close()


def _histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def _add_histogram(fam: HistogramMetricFamily, labels: list[str], h: Histogram) -> None:
    fam.add_metric(labels, buckets=h.cumulative(), sum_value=h.total)


class _CoordinatorCollector(Collector):
    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        c = self.m.c
        if getattr(c, "election", None) is None:
            return  # a scrape while the coordinator is still being made
        leading = bool(c.election.is_leader)
        g = GaugeMetricFamily("rallypoint_coordinator_leader", "1 while this coordinator leads, else 0")
        g.add_metric([], 1.0 if leading else 0.0)
        yield g
        g = GaugeMetricFamily("rallypoint_coordinator_term", "The term this coordinator leads (0: it stands by)")
        g.add_metric([], float(c.election.term or 0) if leading else 0.0)
        yield g
        if leading:
            yield from self._cluster()
        yield from self._jobs()
        yield bad_records_metric()

    def _cluster(self) -> Iterator[Metric]:
        c = self.m.c
        try:
            snap = read_cluster(c.store, c.keys)
        except StoreError:
            return  # etcd away: the cluster gauges are left out of this scrape
        by_state = dict.fromkeys(WORKER_STATES, 0)
        held = free = 0
        leases: dict[str, int] = {}
        for ws in snap.workers.values():
            by_state[ws.state] = by_state.get(ws.state, 0) + 1
            held += len(ws.holders)
            free += len(ws.free)
            for h in ws.holders.values():
                leases[h.job] = leases.get(h.job, 0) + 1
        by_state["lost"] = sum(1 for w in snap.lost if w not in snap.workers)
        g = GaugeMetricFamily("rallypoint_workers", "Workers by state: spare, leased (holds a device lease), "
                              "cordoned, leaving, lost (recorded lost, not registered again)", labels=["state"])
        for state, n in sorted(by_state.items()):
            g.add_metric([state], float(n))
        yield g
        g = GaugeMetricFamily("rallypoint_devices", "Devices of registered workers, held by a job or free",
                              labels=["state"])
        g.add_metric(["held"], float(held))
        g.add_metric(["free"], float(free))
        yield g
        g = GaugeMetricFamily("rallypoint_device_leases", "Device leases each job holds", labels=[JOB_LABEL])
        for job, n in sorted(leases.items()):
            g.add_metric([job], float(n))
        yield g

    def _jobs(self) -> Iterator[Metric]:
        L = [JOB_LABEL]
        state = GaugeMetricFamily("rallypoint_job_state", "1 for the job's current state", labels=[*L, "state"])
        step = GaugeMetricFamily("rallypoint_job_step", "Steps the job has completed (its progress, absolute)",
                                 labels=L)
        done = CounterMetricFamily("rallypoint_job_steps_completed", "Steps this coordinator's executor completed",
                                   labels=L)
        rate = GaugeMetricFamily("rallypoint_job_steps_per_second",
                                 "Mean steps/s of the job since this coordinator started it (until it ended)",
                                 labels=L)
        step_s = _histogram("rallypoint_job_step_seconds", "Per completed step and slice, the compute seconds of "
                            "the slice's first-run instances of that step", [*L, "slice"])
        recs = CounterMetricFamily("rallypoint_job_recoveries", "Recoveries started", labels=L)
        phases = _histogram("rallypoint_job_recovery_phase_seconds", "Each finished recovery phase, in seconds",
                            [*L, "phase"])
        mttr = _histogram("rallypoint_job_mttr_seconds", "Each recovery's MTTR: the loss to the lost work redone",
                          L)
        replayed = CounterMetricFamily("rallypoint_job_replayed_instances", "Instances run again by recoveries",
                                       labels=L)
        drains = CounterMetricFamily("rallypoint_job_drains", "Drains of a worker this job took part in", labels=L)
        good = CounterMetricFamily("rallypoint_goodput_seconds", "Goodput buckets in seconds (docs/metrics.md); "
                                   "the workers export checkpoint_blocking", labels=[*L, "bucket"])
        ratio = GaugeMetricFamily("rallypoint_goodput_ratio", "Compute seconds of first runs over all compute "
                                  "seconds (the chaos report's goodput)", labels=L)
        rollbacks = CounterMetricFamily("rallypoint_job_rollbacks", "Rollbacks from loss spikes (docs/integrity.md)",
                                        labels=L)
        checks = CounterMetricFamily("rallypoint_job_verifications", "Verifications of a slice's steps on another "
                                     "worker, by verdict: matched, mismatched, convicted (a suspect found)",
                                     labels=[*L, "verdict"])
        for ex in self.m.executors():
            try:
                v = _job_values(ex.view())
            except RuntimeError:  # a dict changed size under us (the executor runs): the next scrape has it
                continue
            job = [v["job"]]
            for s in JobState:
                state.add_metric([*job, s.value], 1.0 if v["state"] == s.value else 0.0)
            step.add_metric(job, float(v["completed"]))
            done.add_metric(job, float(v["steps_done"]))
            rate.add_metric(job, v["steps_per_s"])
            for sl, h in sorted(v["step_times"].items()):
                _add_histogram(step_s, [*job, sl], h)
            recs.add_metric(job, float(v["recoveries"]))
            for p in (*PHASES,):
                _add_histogram(phases, [*job, p], histogram_of(v["phases"][p]))
            _add_histogram(mttr, job, histogram_of(v["phases"]["mttr"]))
            replayed.add_metric(job, float(v["replayed"]))
            drains.add_metric(job, float(v["drains"]))
            for b in COORDINATOR_BUCKETS:
                good.add_metric([*job, b], v["buckets"][b])
            rollbacks.add_metric(job, float(v["rollbacks"]))
            for verdict in ("matched", "mismatched", "convicted"):
                checks.add_metric([*job, verdict], float(v["verifications"][verdict]))
            r = goodput_ratio(v["buckets"])
            if r is not None:
                ratio.add_metric(job, r)
        yield from (state, step, done, rate, step_s, recs, phases, mttr, replayed, drains, good, ratio, rollbacks, checks)


def _job_values(v: JobView) -> dict[str, Any]:
    """One executor's numbers, from its view (taken on the scrape thread: copies; the executor's thread goes on)."""
    steps_done = max(v.completed - v.start_step, 0)
    checks = v.integrity.get("verifications") or {}
    return {
        "job": v.job, "state": v.state.value, "completed": v.completed, "steps_done": steps_done,
        "steps_per_s": steps_per_s(steps_done, v.running_s), "step_times": dict(v.step_times),
        "recoveries": len(v.recoveries), "phases": phase_seconds(v.recoveries),
        "replayed": sum(v.replayed.values()), "drains": len(v.drain_records),
        "buckets": goodput_buckets(v.compute_s, v.redone_s, v.recoveries),
        "rollbacks": int(v.integrity.get("rollback_count", 0)),
        "verifications": {"matched": int(checks.get("verified", 0)), "mismatched": int(checks.get("mismatched", 0)),
                          "convicted": int(checks.get("convicted", 0))},
    }
