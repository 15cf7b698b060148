"""Coordinator high availability with real processes: leader killed, leader hung."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from rallypoint.cluster.local import LocalCluster
from rallypoint.etcd.server import EtcdCluster
from tests.conftest import read_events, wait_until
from tests.helpers.cluster import leader



def test_standby_leads_within_ttl_plus_a_second_after_the_leader_is_killed(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    ttl = 2
    lc = local_cluster(workers=1, coordinators=2, lease_ttl_s=ttl)
    old, old_term = wait_until(lambda: leader(lc), 10, "a leader")
    lc.signal(old, signal.SIGKILL)
    killed_at = time.monotonic()
    new, new_term = wait_until(lambda: (l := leader(lc)) and l[0] != old and l, ttl + 5, "a new leader",
                               interval_s=0.02)
    took = time.monotonic() - killed_at
    assert took < ttl + 1.0, f"standby took {took:.2f}s to lead (TTL {ttl}s)"
    assert new_term > old_term
    # The new leader writes its key, then logs the election: the key can be seen before the line is written.
    elected = wait_until(lambda: read_events(lc.process(new).log, "leader.elected"), 5, "the election in its log")
    assert elected[-1]["term"] == new_term


def test_hung_leader_is_deposed_its_writes_refused_and_it_steps_down_on_resume(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    ttl = 1
    lc = local_cluster(workers=2, coordinators=2, lease_ttl_s=ttl)
    old, old_term = wait_until(lambda: leader(lc), 10, "a leader")
    wait_until(lambda: len(read_events(lc.process(old).log, "worker.joined")) >= 2, 10, "leader links")
    lc.signal(old, signal.SIGSTOP)
    try:
        new, new_term = wait_until(lambda: (l := leader(lc)) and l[0] != old and l, 10, "the standby leads")
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
    # Once it stands by, it acts as a leader no more: what it did as one after resuming is all in its log now.
    wait_until(lambda: (states := read_events(lc.process(old).log, "coordinator.state"))
               and states[-1]["state"] == "standby", 10, "the old leader to stand by")
    assert leader(lc) == (new, new_term), "leadership changed hands again"
    # The old leader never recorded a loss, and any transaction it sent under its old term
    # after resuming was refused (it stepped down on the local deadline or on etcd's refusal).
    assert not read_events(lc.process(old).log, "worker.lost")


def test_leadership_listeners_hear_every_lead_and_step_down_and_a_failing_one_changes_nothing(
    etcd: EtcdCluster,
) -> None:
    from rallypoint.orchestrator.service.coordinator import Coordinator, CoordinatorConfig

    heard: list[tuple[str, str, Any]] = []
    coordinators = [Coordinator(CoordinatorConfig(cluster="ha", coordinator_id=f"c{i}", endpoints=tuple(etcd.endpoints),
                                                  lease_ttl_s=1)) for i in range(2)]
    threads = []
    for c in coordinators:
        name = c.config.coordinator_id

        def broken(_arg: Any) -> None:
            raise RuntimeError("a broken listener")

        c.add_leadership_listener(broken, broken)
        c.add_leadership_listener(lambda term, n=name: heard.append((n, "lead", term)),
                                  lambda reason, n=name: heard.append((n, "step_down", reason)))
        threads.append(threading.Thread(target=c.run, daemon=True))
    try:
        for t in threads:
            t.start()
        first, _, term = wait_until(lambda: next((h for h in heard if h[1] == "lead"), None), 10, "a leader")
        leader = next(c for c in coordinators if c.config.coordinator_id == first)
        assert leader.election.term == term
        leader.stop()
        wait_until(lambda: any(h == (first, "step_down", "stopping") for h in heard), 10, "the step-down")
        second = wait_until(lambda: next((h for h in heard if h[1] == "lead" and h[0] != first), None), 10,
                            "the standby leads")
        assert second[2] > term
        assert [h[1] for h in heard if h[0] == first] == ["lead", "step_down"]
    finally:
        for c in coordinators:
            c.stop()
        for t in threads:
            t.join(timeout=10)
    assert heard[-1][1] == "step_down" and heard[-1][2] == "stopping"
