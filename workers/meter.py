"""What a worker counts as it works: the hooks the runtime's modules call, into this process's meter.

A worker process has one :class:`WorkerMeter` (its own registry, made and installed by
:mod:`rallypoint.workers.metrics` when the daemon serves metrics); the functions below add
to it, and do nothing while none is installed (a worker without ``--metrics-port``, unit
tests). They are called from the places that measure: the instance records
(instances, compute seconds), the checkpointer (blocking, save and commit seconds), the
checkpoint restore, the transfers (bytes sent and received) and the host-device copies. ``docs/metrics.md`` lists
the metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram

JOB_LABEL = "job_name"  # not "job": Prometheus sets that to the scrape job
CHECKPOINT_BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class WorkerMeter:
    """The counters and histograms of one worker process, in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        L = [JOB_LABEL]
        self.instances = Counter("rallypoint_worker_instances", "Instances this worker ran (replays included)",
                                 L, registry=registry)
        self.compute = Counter("rallypoint_worker_compute_seconds", "Compute seconds of the instances this worker "
                               "ran (replays included)", L, registry=registry)
        self.blocking = Histogram("rallypoint_worker_checkpoint_blocking_seconds", "Per checkpoint save, how long "
                                  "the slice's device loop waited (until Orbax had its host copy)", L,
                                  buckets=CHECKPOINT_BOUNDS, registry=registry)
        self.goodput = Counter("rallypoint_goodput_seconds", "Goodput buckets in seconds (docs/metrics.md); this "
                               "worker's share of checkpoint_blocking", [*L, "bucket"], registry=registry)
        self.saved = Histogram("rallypoint_worker_checkpoint_save_seconds", "Per checkpoint, the save's start to "
                               "Orbax having finalized it", L, buckets=CHECKPOINT_BOUNDS, registry=registry)
        self.committed = Histogram("rallypoint_worker_checkpoint_commit_seconds", "Per checkpoint, Orbax's "
                                   "finalize to the commit counting (etcd)", L, buckets=CHECKPOINT_BOUNDS,
                                   registry=registry)
        self.restored = Histogram("rallypoint_worker_checkpoint_restore_seconds", "Per restored slice, reading its "
                                  "checkpoint, by tier (memory: a peer's copy, disk)", [*L, "tier"],
                                  buckets=CHECKPOINT_BOUNDS, registry=registry)
        self.transfer = Counter("rallypoint_worker_transfer_bytes", "Tensor bytes pushed to and received from other "
                                "workers (data plane and gRPC Push)", ["direction"], registry=registry)
        self.copies = Counter("rallypoint_worker_copy_bytes", "Tensor bytes copied between host and device, by "
                              "direction (d2h, h2d) and purpose (workers/residency.py)",
                              [*L, "direction", "purpose"], registry=registry)


_meter: WorkerMeter | None = None


def install(meter: WorkerMeter | None) -> None:
    """Make ``meter`` this process's (None: count nothing)."""
    global _meter
    _meter = meter


def current() -> WorkerMeter | None:
    return _meter


def instance(job: str, compute_s: float) -> None:
    m = _meter
    if m is not None:
        m.instances.labels(job).inc()
        m.compute.labels(job).inc(max(compute_s, 0.0))


def checkpoint_blocking(job: str, seconds: float) -> None:
    m = _meter
    if m is not None:
        m.blocking.labels(job).observe(seconds)
        m.goodput.labels(job, "checkpoint_blocking").inc(max(seconds, 0.0))


def checkpoint_saved(job: str, seconds: float) -> None:
    m = _meter
    if m is not None:
        m.saved.labels(job).observe(seconds)


def checkpoint_committed(job: str, seconds: float) -> None:
    m = _meter
    if m is not None:
        m.committed.labels(job).observe(seconds)


def checkpoint_restored(job: str, tier: str, seconds: float) -> None:
    m = _meter
    if m is not None:
        m.restored.labels(job, tier).observe(seconds)


def copied(job: str, direction: str, purpose: str, nbytes: int) -> None:
    """``nbytes`` of ``job`` copied ``d2h`` or ``h2d`` for ``purpose`` (:mod:`rallypoint.workers.residency`)."""
    m = _meter
    if m is not None:
        m.copies.labels(job, direction, purpose).inc(nbytes)


def payload_bytes(leaves: Sequence[Any]) -> int:
    return sum(int(x.nbytes) if hasattr(x, "nbytes") else int(np.asarray(x).nbytes) for x in leaves)


def transferred(direction: str, leaves: Sequence[Any]) -> None:
    """``direction``: ``sent`` or ``received``; counts the leaves' tensor bytes."""
    m = _meter
    if m is not None:
        m.transfer.labels(direction).inc(payload_bytes(leaves))
