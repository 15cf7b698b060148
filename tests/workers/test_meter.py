"""The worker's meter hooks (workers/meter.py) and the metrics HTTP server (basics/metrics_server.py)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from rallypoint.basics.metrics_server import MetricsServer
from rallypoint.workers import meter
from rallypoint.workers.meter import WorkerMeter


@pytest.fixture
def installed() -> Iterator[CollectorRegistry]:
    registry = CollectorRegistry()
    meter.install(WorkerMeter(registry))
    try:
        yield registry
    finally:
        meter.install(None)


def test_hooks_count_nothing_without_a_meter() -> None:
    assert meter.current() is None
    meter.instance("j", 1.0)  # no error, nowhere to count
    meter.transferred("sent", [np.zeros(4)])


def test_hooks_count_into_the_installed_meter(installed: CollectorRegistry) -> None:
    get = installed.get_sample_value
    meter.instance("j", 0.25)
    meter.instance("j", 0.5)
    meter.checkpoint_blocking("j", 0.01)
    meter.checkpoint_blocking("j", 0.03)
    meter.checkpoint_saved("j", 0.2)
    meter.checkpoint_committed("j", 0.05)
    meter.checkpoint_restored("j", "memory", 0.1)
    meter.transferred("sent", [np.zeros((2, 3), np.float32), np.zeros(5, np.int64)])
    meter.transferred("received", [np.zeros(1, np.float64)])
    assert get("rallypoint_worker_instances_total", {"job_name": "j"}) == 2
    assert get("rallypoint_worker_compute_seconds_total", {"job_name": "j"}) == pytest.approx(0.75)
    assert get("rallypoint_worker_checkpoint_blocking_seconds_count", {"job_name": "j"}) == 2
    assert get("rallypoint_goodput_seconds_total", {"job_name": "j", "bucket": "checkpoint_blocking"}) == \
        pytest.approx(0.04)
    assert get("rallypoint_worker_checkpoint_save_seconds_count", {"job_name": "j"}) == 1
    assert get("rallypoint_worker_checkpoint_commit_seconds_sum", {"job_name": "j"}) == pytest.approx(0.05)
    assert get("rallypoint_worker_checkpoint_restore_seconds_count", {"job_name": "j", "tier": "memory"}) == 1
    assert get("rallypoint_worker_transfer_bytes_total", {"direction": "sent"}) == 2 * 3 * 4 + 5 * 8
    assert get("rallypoint_worker_transfer_bytes_total", {"direction": "received"}) == 8


def test_the_server_serves_its_own_registry_on_a_free_port(installed: CollectorRegistry) -> None:
    meter.instance("served", 1.5)
    server = MetricsServer(installed, port=0)
    try:
        assert server.address.startswith("127.0.0.1:") and not server.address.endswith(":0")
        with urllib.request.urlopen(server.url, timeout=10) as r:
            text = r.read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert samples[("rallypoint_worker_instances_total", (("job_name", "served"),))] == 1.0
        assert not any(name.startswith("process_") for name, _ in samples), "the global registry leaked in"
    finally:
        server.close()
