"""The local cluster's zygote (cluster/zygote.py): workers forked from one process that imported JAX.

Real processes: a real cluster's zygote forks its workers and a lost worker's replacement; without it
(turned off, or gone) a worker is a fresh process of the launcher, as before.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rallypoint.basics.errors import RallypointError
from rallypoint.cluster.local import LocalCluster, is_running, stop_process
from tests.conftest import wait_until


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_workers_and_a_lost_ones_replacement_are_forked_by_the_zygote_whose_socket_goes_with_the_cluster(
        local_cluster: Callable[..., LocalCluster]) -> None:
    lc = local_cluster(workers=2, spares=0, coordinators=1)
    (z,) = [p for p in lc.processes if p.role == "zygote"]
    workers = [p for p in lc.processes if p.role == "worker"]
    assert len(workers) == 2 and all(parent(w.pid) == z.pid for w in workers), (z, workers)
    assert all(parent(p.pid) == os.getpid() for p in lc.processes if p.role in ("coordinator", "zygote"))
    # A worker killed: gone by its pid and start time (the zygote reaped it), and its replacement forked too.
    os.kill(workers[0].pid, signal.SIGKILL)
    wait_until(lambda: not is_running(workers[0]), 10, "the killed worker to be gone")
    new = lc.spawn("worker", workers[0].name)
    assert new.pid != workers[0].pid and parent(new.pid) == z.pid
    assert "worker.registered" in wait_until(lambda: _logged(new.log, "worker.registered"), 60, "the new worker")
    sock = Path(z.argv[-1])
    assert sock.is_socket() and oct(sock.parent.stat().st_mode & 0o777) == "0o700"
    lc.stop()
    assert not sock.parent.exists() and not any(is_running(p) for p in lc.processes)


def test_without_a_zygote_or_once_it_is_gone_a_worker_is_a_fresh_process_of_the_launcher(
        local_cluster: Callable[..., LocalCluster]) -> None:
    off = local_cluster(workers=1, spares=0, coordinators=1, zygote=False)
    assert "zygote" not in {p.role for p in off.processes}
    assert all(parent(p.pid) == os.getpid() for p in off.processes if p.role == "worker")
    lc = local_cluster(workers=1, spares=0, coordinators=1)
    (z,) = [p for p in lc.processes if p.role == "zygote"]
    stop_process(z)
    new = lc.spawn("worker", "w1")
    assert parent(new.pid) == os.getpid()
    assert lc.wait_for_workers(2)


def _logged(log: str, event: str) -> str:
    text = Path(log).read_text(errors="replace")
    return text if event in text else ""


def test_a_cluster_returns_from_its_start_with_a_leader_and_waits_for_one_that_lags(
        local_cluster: Callable[..., LocalCluster]) -> None:
    """Workers forked from the zygote come up before the coordinators (which import more): the start waits for a
    leader too. (CI's test_metrics scraped a cluster just started and found no coordinator.)"""
    lc = local_cluster(workers=1, spares=0, coordinators=1, lease_ttl_s=2)
    store = lc.store()
    try:
        assert store.get(lc.keys.leader) is not None, "the start returned before any coordinator led"
        (c,) = [p for p in lc.processes if p.role == "coordinator"]
        os.kill(c.pid, signal.SIGSTOP)  # its lease expires: no leader until it runs again
        try:
            wait_until(lambda: store.get(lc.keys.leader) is None, 15, "the frozen leader's key to expire")
        finally:
            threading.Timer(1.0, os.kill, (c.pid, signal.SIGCONT)).start()
        t0 = time.monotonic()
        lc.wait_for_leader(timeout_s=30)
        assert store.get(lc.keys.leader) is not None and time.monotonic() - t0 >= 0.5
        lc.signal(c.name, signal.SIGKILL)  # every coordinator gone: said at once, with its log
        wait_until(lambda: store.get(lc.keys.leader) is None, 15, "the killed leader's key to expire")
        with pytest.raises(RallypointError, match="every coordinator exited"):
            lc.wait_for_leader(timeout_s=30)
    finally:
        store.close()
