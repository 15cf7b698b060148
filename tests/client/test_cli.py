"""The `rallypoint` CLI as a user runs it: real subprocesses, a real local cluster."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rallypoint.cluster.local import STATE_FILE, LocalCluster, is_running
from rallypoint.etcd.cluster_view import read_cluster
from tests.conftest import read_events, wait_until
from tests.helpers.cli import rp

pytestmark = pytest.mark.processes  # every test here starts processes

def rows(*args: str) -> dict[str, dict]:
    return {row["worker"]: row for row in map(json.loads, rp("workers", "--json", *args).stdout.splitlines())}


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "state"
    try:
        yield d
    finally:
        if (d / STATE_FILE).exists():
            LocalCluster.load(d).stop()


def test_up_workers_cordon_uncordon_down_and_down_stops_only_what_up_started(state_dir: Path) -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])  # killed below
    try:
        up_workers_cordon_uncordon_down(state_dir)
        assert bystander.poll() is None, "down killed a process it did not start"
    finally:
        bystander.kill()
        bystander.wait()


def up_workers_cordon_uncordon_down(state_dir: Path) -> None:
    out = rp("up", "--state-dir", str(state_dir), "--workers", "1", "--spares", "1", "--devices-per-worker", "2",
             "--coordinators", "2").stdout
    assert "rallypoint workers" in out and "rallypoint down" in out
    lc = LocalCluster.load(state_dir)
    assert {p.role for p in lc.processes} == {"etcd", "coordinator", "worker", "supervisor", "zygote"}
    assert all(is_running(p) for p in lc.processes)
    # `up` prints the leader's dashboard (the page itself: tests/integration/test_dashboard.py), and it answers.
    m = re.search(r"dashboard: (http://127\.0\.0\.1:\d+/)", out)
    assert m, out
    dashboard = m.group(1)
    with urllib.request.urlopen(dashboard + "api/cluster", timeout=5) as r:
        body = json.loads(r.read())
    assert body["leading"] and sorted(w["worker"] for w in body["workers"]) == ["w0", "w1"]
    with urllib.request.urlopen(dashboard, timeout=5) as r:
        assert "<title>Rallypoint dashboard</title>" in r.read().decode()

    table = rows("--state-dir", str(state_dir))
    assert set(table) == {"w0", "w1"}
    for w, row in table.items():
        assert row["state"] == "spare" and row["devices"] == 2 and row["alive"]
        assert row["pid"] == lc.process(w).pid and row["incarnation"] > 0
        assert (row["platform"], row["device_kind"], row["device_memory_bytes"]) == ("cpu", "cpu", 0)
    human = rp("workers", "--state-dir", str(state_dir)).stdout
    assert "w0" in human and "spare" in human and "leader" in human and dashboard in human
    assert "cpu x2 (host memory)" in human, human

    rp("cordon", "w1", "--state-dir", str(state_dir))
    assert rows("--state-dir", str(state_dir))["w1"]["state"] == "cordoned"
    # --cluster reaches the same cluster with its certificates; without them it is refused, and without its
    # name it cannot be found (etcd auth lets the client list only its own cluster's keys).
    endpoints = ",".join(lc.endpoints)
    tls = ("--tls-dir", str(state_dir / "tls"))
    assert rows("--cluster", f"local@{endpoints}", *tls)["w1"]["state"] == "cordoned"
    r = rp("workers", "--cluster", f"local@{endpoints}", check=False)
    assert r.returncode == 1 and "--tls-dir" in r.stderr and "--insecure" in r.stderr
    r = rp("workers", "--cluster", endpoints, *tls, check=False)
    assert r.returncode == 1 and "name the cluster" in r.stderr
    assert "uncordoned" in rp("uncordon", "w1", "--state-dir", str(state_dir)).stdout
    assert rows("--state-dir", str(state_dir))["w1"]["state"] == "spare"

    # Supervised (`up`'s default): a worker killed by a real signal is started again by the supervise daemon and
    # registers as a new incarnation, a spare; the state file records the new process, so `down` stops it.
    old = table["w1"]
    os.kill(old["pid"], signal.SIGKILL)
    store = lc.store()
    try:
        new = wait_until(lambda: (w := read_cluster(store, lc.keys).workers.get("w1")) and
                         w.info.incarnation > old["incarnation"] and w, 60, "w1 registered again", interval_s=0.2)
    finally:
        store.close()
    assert new.info.pid != old["pid"] and new.state == "spare"
    restarted = LocalCluster.load(state_dir)
    assert restarted.process("w1").pid == new.info.pid

    assert "stopped" in rp("down", "--state-dir", str(state_dir)).stdout
    assert not any(is_running(p) for p in [*lc.processes, *restarted.processes]), "down left processes running"
    assert not (state_dir / STATE_FILE).exists()
    # Workers left cleanly (said so before their leases went), so nobody but the killed incarnation was lost.
    coord_logs = [p.log for p in lc.processes if p.role == "coordinator"]
    assert {e["worker"] for log in coord_logs for e in read_events(log, "worker.lost")} <= {"w1"}
    assert {e["worker"] for log in coord_logs for e in read_events(log, "worker.left")} == {"w0", "w1"}
    r = rp("down", "--state-dir", str(state_dir), check=False)
    assert r.returncode == 1 and "rallypoint up" in r.stderr


def test_bad_arguments_get_a_clear_message_a_nonzero_exit_and_change_nothing_and_a_lost_worker_is_shown(
    state_dir: Path, tmp_path: Path,
) -> None:
    r = rp("up", "--state-dir", str(state_dir), "--workers", "0", check=False)
    assert r.returncode == 1 and "--workers must be at least 1" in r.stderr
    assert not state_dir.exists(), "a rejected `up` created state"
    r = rp("up", "--state-dir", str(state_dir), "--etcd-members", "2", check=False)
    assert r.returncode == 2 and "etcd-members" in r.stderr

    empty = tmp_path / "empty"
    r = rp("workers", "--state-dir", str(empty), check=False)
    assert r.returncode == 1 and "rallypoint up" in r.stderr
    r = rp("workers", "--cluster", "not-an-address", check=False)
    assert r.returncode == 1 and "HOST:PORT" in r.stderr

    rp("up", "--state-dir", str(state_dir), "--workers", "1", "--spares", "0", "--devices-per-worker", "1",
       "--coordinators", "1", "--lease-ttl-s", "1", "--no-supervise")  # the worker killed below stays dead
    lc = LocalCluster.load(state_dir)
    before = rows("--state-dir", str(state_dir))
    r = rp("cordon", "nope", "--state-dir", str(state_dir), check=False)
    assert r.returncode == 1 and "no worker 'nope'" in r.stderr
    r = rp("cordon", "bad/name", "--state-dir", str(state_dir), check=False)
    assert r.returncode == 1 and "invalid worker name" in r.stderr
    r = rp("up", "--state-dir", str(state_dir), check=False)
    assert r.returncode == 1 and "still running" in r.stderr
    assert LocalCluster.load(state_dir).processes == lc.processes, "a rejected `up` touched the running cluster"
    assert all(is_running(p) for p in lc.processes)
    assert rows("--state-dir", str(state_dir)) == before

    # The same cluster: a killed worker is shown lost.
    lc.signal("w0", signal.SIGKILL)
    lost = wait_until(lambda: (r := rows("--state-dir", str(state_dir)).get("w0")) and r["state"] == "lost" and r,
                      15, "w0 shown lost")
    assert lost["alive"] is False and lost["pid"] == lc.process("w0").pid
