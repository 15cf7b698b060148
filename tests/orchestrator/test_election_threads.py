"""The election's term and lease under concurrent writers, and a coordinator thread that survives its own bugs.

Pure logic against :class:`tests.fakes.MemoryStore`: no process starts.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest

from rallypoint.basics.errors import NotLeader
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import Put
from rallypoint.orchestrator.service import coordinator as coordinator_module
from rallypoint.orchestrator.service.coordinator import Coordinator, CoordinatorConfig, CoordinatorState
from rallypoint.orchestrator.control.election import LeaderElection
from tests.fakes import MemoryStore

KEYS = Keys("t")


def test_a_writers_fence_is_its_own_term_even_when_the_coordinator_leads_a_newer_one_mid_write() -> None:
    store = MemoryStore()
    e = LeaderElection(store, KEYS, "c1", ttl_s=2)
    try:
        assert e.try_acquire()
        w = e.writer()
        real_check = e.check

        def check_then_lead_again() -> None:  # the term changes between the writer's check and its txn
            real_check()
            e.check = real_check  # type: ignore[method-assign]
            e.step_down("deposed")
            assert e.try_acquire()

        e.check = check_then_lead_again  # type: ignore[method-assign]
        with pytest.raises(NotLeader, match=f"term {w.term} is over"):
            w.txn([], [Put("/x", "late write of the old term")])
        assert store.get("/x") is None, "the old term's write went through under the new term's fence"
        assert e.term is not None and e.term != w.term and e.is_leader, "the old writer's refusal ended the new term"
    finally:
        e.resign()


def test_writers_of_old_terms_stepping_down_while_campaigns_run_never_end_the_new_term() -> None:
    store = MemoryStore()
    e = LeaderElection(store, KEYS, "c1", ttl_s=5)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as finely as the interpreter allows
    stop = threading.Event()
    writers: list[Any] = []
    errors: list[BaseException] = []

    def executor() -> None:  # writes under whichever term it was handed; refused ones step down
        while not stop.is_set():
            for w in list(writers[-3:]):
                try:
                    w.txn([], [])
                except NotLeader:
                    pass
                except BaseException as exc:  # noqa: BLE001 - anything else is the bug under test
                    errors.append(exc)

    threads = [threading.Thread(target=executor, daemon=True) for _ in range(4)]
    try:
        assert e.try_acquire()
        writers.append(e.writer())
        for t in threads:
            t.start()
        for cycle in range(50):
            e.step_down(f"cycle {cycle}", keep_lease=cycle % 2 == 0)
            assert e.try_acquire(), f"cycle {cycle}: the campaign lost to nobody"
            term, keeper = e.held()
            assert term is not None and keeper is not None, f"cycle {cycle}: a writer ended the term just won"
            leader = store.get(KEYS.leader)
            assert leader is not None and leader.lease == keeper.lease_id and leader.create_revision == term, \
                f"cycle {cycle}: a writer revoked the lease of the term just won"
            assert keeper.lease_id in store.leases
            writers.append(e.writer())
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        sys.setswitchinterval(interval)
        e.resign()
    assert not errors, errors[:3]


class _NoMembership:
    """Stands in for the etcd membership watch (MemoryStore has no watches)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def test_an_unexpected_error_on_the_coordinator_thread_steps_it_down_and_it_leads_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator_module, "MembershipMonitor", _NoMembership)
    store = MemoryStore()
    c = Coordinator(CoordinatorConfig(cluster="t", coordinator_id="c1", endpoints=("unused:1",),
                                      campaign_interval_s=0.01, suspect_after_s=0), store=store)
    terms: list[int] = []
    downs: list[str] = []
    led_twice = threading.Event()

    def on_lead(term: int) -> None:
        terms.append(term)
        if len(terms) == 2:
            led_twice.set()

    c.add_leadership_listener(on_lead, downs.append)
    real_lead_step, crashed = c.lead_step, []

    def lead_step(timeout_s: float = 0.25) -> None:
        if not crashed:
            crashed.append(True)
            raise KeyError("a bug in the leader loop")
        real_lead_step(timeout_s=0.01)

    c.lead_step = lead_step  # type: ignore[method-assign]
    thread = threading.Thread(target=c.run, daemon=True)
    thread.start()
    try:
        assert led_twice.wait(10), f"it did not lead again after the error (terms {terms}, downs {downs})"
        assert thread.is_alive()
        assert len(downs) == 1 and "KeyError" in downs[0] and "a bug in the leader loop" in downs[0]
        assert terms[1] > terms[0], "a crash revokes the lease: the next term is a new one"
        assert c.state is CoordinatorState.LEADING and c.election.is_leader
    finally:
        c.stop()
        thread.join(10)
    assert not thread.is_alive() and c.state is CoordinatorState.STOPPED
