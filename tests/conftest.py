"""Shared fixtures: real etcd and real local clusters on free loopback ports, in tmp dirs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import pytest

from rallypoint.etcd.server import EtcdCluster
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig, is_running
from rallypoint.etcd.store import EtcdStore

# The client-side tests compile programs for slices of up to 4 devices and run the
# reference on several device sets: give this process 8 CPU devices before any JAX
# operation runs. (A config, not XLA_FLAGS, so worker processes do not inherit it.)
jax.config.update("jax_num_cpu_devices", 8)


SESSION_NOTES: list[str] = []
"""Lines for the end of the session's output (a screenshot's path, why a browser test skipped)."""


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SESSION_NOTES:
        terminalreporter.write_sep("-", "notes")
        for line in SESSION_NOTES:
            terminalreporter.write_line(line)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A single-member etcd (50 ms heartbeat, 500 ms election: 1 s TTLs allowed), on plain http without auth:
    tests of the store and of single components; every local cluster runs etcd with TLS and auth."""
    cluster = EtcdCluster.start(members=1, base_dir=tmp_path / "etcd", tls=None)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def store(etcd: EtcdCluster) -> Iterator[EtcdStore]:
    s = EtcdStore(etcd.endpoints, tls=None)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def local_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """Factory for local clusters of real processes; every process is stopped and checked gone."""
    started: list[LocalCluster] = []

    def start(**overrides: Any) -> LocalCluster:
        settings: dict[str, Any] = {
            "workers": 2, "spares": 0, "devices_per_worker": 1, "coordinators": 2, "lease_ttl_s": 2,
        } | overrides
        cfg = LocalClusterConfig(state_dir=tmp_path / f"cluster{len(started)}", **settings)
        lc = LocalCluster.start(cfg)
        started.append(lc)
        return lc

    try:
        yield start
    finally:
        for lc in started:
            lc.stop()
            left = [p for p in lc.processes if is_running(p)]
            assert not left, f"processes left running: {left}"


def read_events(log_path: str | Path, event: str | None = None) -> list[dict[str, Any]]:
    """JSON log events of one process log (non-JSON lines skipped), optionally of one name."""
    out = []
    try:
        text = Path(log_path).read_text(errors="replace")
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event is None or rec.get("event") == event:
            out.append(rec)
    return out


def wait_until(pred: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something truthy; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
