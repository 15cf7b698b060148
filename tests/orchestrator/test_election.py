"""Leader election and fenced writes against a real etcd."""

from __future__ import annotations

import pytest

from rallypoint.orchestrator.control.election import LeaderElection
from rallypoint.basics.errors import NotLeader
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.store import Put

KEYS = Keys("t")


def test_one_leader_at_a_time_and_the_term_is_the_leader_keys_create_revision(store: EtcdStore) -> None:
    a = LeaderElection(store, KEYS, "a", ttl_s=5)
    b = LeaderElection(store, KEYS, "b", ttl_s=5)
    try:
        assert a.try_acquire()
        assert not b.try_acquire()
        kv = store.get(KEYS.leader)
        assert kv is not None and kv.json()["coordinator"] == "a"
        assert a.term == kv.create_revision
        assert b.current_leader() == ("a", a.term)
        # Campaigning again while leading keeps the same term.
        assert a.try_acquire() and a.term == kv.create_revision
    finally:
        a.resign()
        b.resign()


def test_a_deposed_leaders_write_is_refused_by_etcd_and_it_steps_down(store: EtcdStore) -> None:
    a = LeaderElection(store, KEYS, "a", ttl_s=10)
    b = LeaderElection(store, KEYS, "b", ttl_s=10)
    try:
        assert a.try_acquire()
        old_term = a.term
        a.fenced_txn([], [Put(KEYS.job("j"), "by-a")])
        # a's lease ends behind its back (as when it was frozen past its TTL) and b takes over;
        # a's local deadline (10 s TTL) has not passed, so only etcd can refuse it.
        assert a.keeper is not None
        store.revoke_lease(a.keeper.lease_id)
        assert b.try_acquire()
        assert a.keeper.fence.valid(), "the test needs a's local fence still valid"
        with pytest.raises(NotLeader, match="refused by etcd"):
            a.fenced_txn([], [Put(KEYS.job("j"), "late write by a")])
        assert store.get(KEYS.job("j")).value == b"by-a"
        assert a.term is None and not a.is_leader
        b.fenced_txn([], [Put(KEYS.job("j"), "by-b")])
        assert store.get(KEYS.job("j")).value == b"by-b"
        assert b.term is not None and old_term is not None and b.term > old_term
    finally:
        a.resign()
        b.resign()


def test_a_leader_past_its_local_deadline_refuses_to_write_without_asking_etcd(store: EtcdStore) -> None:
    a = LeaderElection(store, KEYS, "a", ttl_s=5)
    try:
        assert a.try_acquire()
        assert a.keeper is not None
        a.keeper.fence.arm(-1e9, 0)  # no effect: arm never moves the deadline back
        assert a.is_leader
        a.keeper.fence.kill("test: lease gone")
        with pytest.raises(NotLeader):
            a.fenced_txn([], [Put(KEYS.job("j"), "x")])
        assert store.get(KEYS.job("j")) is None
    finally:
        a.resign()


def test_resign_frees_the_lead_for_a_standby(store: EtcdStore) -> None:
    a = LeaderElection(store, KEYS, "a", ttl_s=5)
    b = LeaderElection(store, KEYS, "b", ttl_s=5)
    try:
        assert a.try_acquire()
        a.resign()
        assert store.get(KEYS.leader) is None
        assert b.try_acquire()
    finally:
        b.resign()


def test_a_term_writer_writes_under_its_term_only_even_when_the_coordinator_leads_again() -> None:
    from tests.fakes import MemoryStore

    store, keys = MemoryStore(), Keys("t")
    e = LeaderElection(store, keys, "c1", ttl_s=2)
    try:
        assert e.try_acquire()
        w = e.writer()
        w.txn([], [Put("/x", "1")])
        e.step_down("etcd was away", keep_lease=True)  # only the local deadline passed: the term may come back
        assert not w.holds and not w.over
        assert e.try_acquire() and e.term == w.term and w.holds  # the same term again
        e.step_down("deposed")  # the lease is revoked: this term is over for good
        assert w.over
        assert e.try_acquire() and e.term != w.term  # leads again, under a newer term
        assert w.over and not w.holds
        with pytest.raises(NotLeader, match=f"term {w.term} is over"):
            w.txn([], [Put("/x", "2")])
        assert store.get("/x").value == b"1"  # type: ignore[union-attr]
        e.writer().txn([], [Put("/x", "3")])  # the new term's writer writes
        assert store.get("/x").value == b"3"  # type: ignore[union-attr]
    finally:
        e.resign()
