"""Coordinator high availability with real processes: leader killed, leader hung."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from rallypoint.cluster.local import LocalCluster
from tests.conftest import read_events, wait_until


def _leader(lc: LocalCluster) -> tuple[str, int] | None:
    store = lc.store()
    try:
        kv = store.get(lc.keys.leader)
    finally:
        store.close()
    return (kv.json()["coordinator"], kv.create_revision) if kv else None


def test_standby_leads_within_ttl_plus_a_second_after_the_leader_is_killed(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    ttl = 2
    lc = local_cluster(workers=1, coordinators=2, lease_ttl_s=ttl)
    old, old_term = wait_until(lambda: _leader(lc), 10, "a leader")
    lc.signal(old, signal.SIGKILL)
    killed_at = time.monotonic()
    new, new_term = wait_until(lambda: (l := _leader(lc)) and l[0] != old and l, ttl + 5, "a new leader",
                               interval_s=0.02)
    took = time.monotonic() - killed_at
    assert took < ttl + 1.0, f"standby took {took:.2f}s to lead (TTL {ttl}s)"
    assert new_term > old_term
    elected = read_events(lc.process(new).log, "leader.elected")
    assert elected[-1]["term"] == new_term


def test_hung_leader_is_deposed_its_writes_refused_and_it_steps_down_on_resume(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    ttl = 1
    lc = local_cluster(workers=2, coordinators=2, lease_ttl_s=ttl)
    old, old_term = wait_until(lambda: _leader(lc), 10, "a leader")
    wait_until(lambda: len(read_events(lc.process(old).log, "worker.joined")) >= 2, 10, "leader links")
    lc.signal(old, signal.SIGSTOP)
    try:
        new, new_term = wait_until(lambda: (l := _leader(lc)) and l[0] != old and l, 10, "the standby leads")
        # While the old leader is frozen, a worker dies: only the new leader may record it.
        wait_until(lambda: len(read_events(lc.process(new).log, "worker.joined")) >= 2, 10, "new leader links")
        lc.signal("w0", signal.SIGKILL)
        store = lc.store()
        try:
            lost = wait_until(lambda: store.get(lc.keys.lost("w0")), 6, "w0 recorded lost").json()
        finally:
            store.close()
        assert lost["term"] == new_term
    finally:
        lc.signal(old, signal.SIGCONT)
    deposed = wait_until(lambda: read_events(lc.process(old).log, "leader.deposed"), 10, "old leader steps down")
    assert deposed[0]["term"] == old_term
    time.sleep(1.0)
    assert _leader(lc) == (new, new_term), "leadership changed hands again"
    # The old leader never recorded a loss, and any transaction it sent under its old term
    # after resuming was refused (it stepped down on the local deadline or on etcd's refusal).
    assert not read_events(lc.process(old).log, "worker.lost")
    states = read_events(lc.process(old).log, "coordinator.state")
    assert states[-1]["state"] == "standby"
