"""Pure tests of orchestrator.membership.MembershipView (no etcd)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.etcd.keys import Keys
from rallypoint.basics.errors import StoreError
from rallypoint.orchestrator.control.membership import MembershipChange, MembershipMonitor, MembershipView
from tests.fakes import MemoryStore
from rallypoint.etcd.cluster_view import WorkerInfo
from rallypoint.etcd.store import KeyValue, WatchBatch, WatchEvent

KEYS = Keys("t")


def _record(state: str = "serving", *, address: str = "127.0.0.1:7000", pid: int = 42,
            devices: int = 4, **extra: Any) -> bytes:
    return json.dumps({"address": address, "pid": pid, "devices": devices, "state": state,
                       **extra}).encode()


def _kv(key: str, value: bytes, create: int, mod: int | None = None, *, version: int = 1,
        lease: int = 0x77) -> KeyValue:
    return KeyValue(key=key, value=value, create_revision=create,
                    mod_revision=create if mod is None else mod, version=version, lease=lease)


def _put(kv: KeyValue, prev: KeyValue | None = None) -> WatchEvent:
    return WatchEvent(type="put", kv=kv, prev=prev)


def _delete(key: str, revision: int, prev: KeyValue | None) -> WatchEvent:
    # etcd's delete event carries only the key and the deletion revision.
    return WatchEvent(type="delete", kv=KeyValue(key, b"", 0, revision, 0, 0), prev=prev)


def _batch(*events: WatchEvent, revision: int | None = None) -> WatchBatch:
    rev = revision if revision is not None else max(e.kv.mod_revision for e in events)
    return WatchBatch(revision=rev, events=list(events))


def _kinds(changes: list[MembershipChange]) -> list[tuple[str, str, int]]:
    return [(c.kind, c.worker, c.info.incarnation) for c in changes]


# --- apply ---------------------------------------------------------------------------------


def test_create_registers_the_worker() -> None:
    view = MembershipView(KEYS)
    kv = _kv(KEYS.worker("w1"), _record(address="10.0.0.1:9", pid=7, devices=2), 5, lease=0xABC)
    changes = view.apply(_batch(_put(kv)))
    assert _kinds(changes) == [("registered", "w1", 5)]
    assert changes[0].revision == 5
    info = view.workers["w1"]
    assert info == changes[0].info
    assert (info.worker, info.incarnation, info.lease, info.address, info.pid, info.devices, info.state) == (
        "w1", 5, 0xABC, "10.0.0.1:9", 7, 2, "serving")
    assert view.revision == 5


def test_record_defaults_when_fields_are_missing() -> None:
    info = WorkerInfo.from_kv("w1", _kv(KEYS.worker("w1"), b"{}", 3))
    assert (info.address, info.pid, info.devices, info.state, info.record) == ("", 0, 0, "serving", {})


def test_put_of_the_same_incarnation_is_an_update() -> None:
    view = MembershipView(KEYS)
    first = _kv(KEYS.worker("w1"), _record(), 5)
    view.apply(_batch(_put(first)))
    second = _kv(KEYS.worker("w1"), _record("leaving"), 5, 9, version=2)
    changes = view.apply(_batch(_put(second, prev=first)))
    assert _kinds(changes) == [("updated", "w1", 5)]
    assert changes[0].revision == 9
    assert view.workers["w1"].state == "leaving"


def test_delete_after_leaving_is_left() -> None:
    view = MembershipView(KEYS)
    leaving = _kv(KEYS.worker("w1"), _record("leaving"), 5, 6, version=2)
    view.apply(_batch(_put(_kv(KEYS.worker("w1"), _record(), 5)), _put(leaving)))
    changes = view.apply(_batch(_delete(KEYS.worker("w1"), 8, prev=leaving)))
    assert _kinds(changes) == [("left", "w1", 5)]
    assert changes[0].revision == 8 and changes[0].info.state == "leaving"
    assert view.workers == {}


def test_delete_of_a_serving_worker_is_lost() -> None:
    view = MembershipView(KEYS)
    kv = _kv(KEYS.worker("w1"), _record(), 5)
    view.apply(_batch(_put(kv)))
    changes = view.apply(_batch(_delete(KEYS.worker("w1"), 11, prev=kv)))
    assert _kinds(changes) == [("lost", "w1", 5)]
    assert changes[0].revision == 11
    assert "w1" not in view.workers


def test_delete_judged_by_prev_record_not_by_the_view() -> None:
    view = MembershipView(KEYS)
    view.apply(_batch(_put(_kv(KEYS.worker("w1"), _record(), 5))))
    leaving = _kv(KEYS.worker("w1"), _record("leaving"), 5, 6, version=2)
    # The view missed the "leaving" update, but the delete's prev carries it.
    changes = view.apply(_batch(_delete(KEYS.worker("w1"), 7, prev=leaving), revision=7))
    assert _kinds(changes) == [("left", "w1", 5)]


def test_delete_without_prev_uses_the_known_record() -> None:
    view = MembershipView(KEYS)
    view.apply(_batch(_put(_kv(KEYS.worker("w1"), _record(), 5))))
    assert _kinds(view.apply(_batch(_delete(KEYS.worker("w1"), 7, prev=None)))) == [("lost", "w1", 5)]
    # A delete of a worker never seen, without prev, says nothing.
    assert view.apply(_batch(_delete(KEYS.worker("w2"), 8, prev=None))) == []
    assert view.workers == {} and view.revision == 8


def test_new_incarnation_without_a_seen_delete_is_lost_then_registered() -> None:
    view = MembershipView(KEYS)
    view.apply(_batch(_put(_kv(KEYS.worker("w1"), _record(address="old:1"), 5))))
    new = _kv(KEYS.worker("w1"), _record(address="new:1"), 12)
    changes = view.apply(_batch(_put(new)))
    assert _kinds(changes) == [("lost", "w1", 5), ("registered", "w1", 12)]
    assert changes[0].info.address == "old:1" and changes[1].info.address == "new:1"
    assert all(c.revision == 12 for c in changes)
    assert view.workers["w1"].incarnation == 12


def test_keys_not_directly_under_workers_are_ignored() -> None:
    view = MembershipView(KEYS)
    other = Keys("t2")
    events = [
        _put(_kv(KEYS.workers + "w1/extra", _record(), 2)),
        _put(_kv(KEYS.device("w1", 0), b"{}", 3)),
        _put(_kv(KEYS.lease("w1", 0), b"{}", 4)),
        _put(_kv(other.worker("w1"), _record(), 5)),
        _put(_kv(KEYS.workers, _record(), 6)),
        _delete(KEYS.workers + "w1/extra", 7, prev=_kv(KEYS.workers + "w1/extra", _record(), 2)),
    ]
    assert view.apply(_batch(*events)) == []
    assert view.workers == {}
    assert view.revision == 7


def test_one_batch_yields_changes_in_event_order() -> None:
    view = MembershipView(KEYS)
    a, b = _kv(KEYS.worker("a"), _record(), 3), _kv(KEYS.worker("b"), _record(), 4)
    changes = view.apply(_batch(_put(b), _put(a), _delete(KEYS.worker("b"), 5, prev=b)))
    assert _kinds(changes) == [("registered", "b", 4), ("registered", "a", 3), ("lost", "b", 4)]
    assert [c.revision for c in changes] == [4, 3, 5]


def test_revision_advances_and_never_goes_back() -> None:
    view = MembershipView(KEYS)
    assert view.revision == 0
    view.apply(WatchBatch(revision=10, events=[]))  # "watch established" batch
    assert view.revision == 10
    view.apply(_batch(_put(_kv(KEYS.worker("w1"), _record(), 12)), revision=15))
    assert view.revision == 15
    view.apply(WatchBatch(revision=9, events=[]))
    assert view.revision == 15
    view.resync([], 20)
    assert view.revision == 20


# --- resync --------------------------------------------------------------------------------


def test_resync_reports_only_differences() -> None:
    view = MembershipView(KEYS)
    stay = _kv(KEYS.worker("stay"), _record(), 2)
    gone = _kv(KEYS.worker("gone"), _record(), 3)
    went = _kv(KEYS.worker("went"), _record("leaving"), 4)
    edited = _kv(KEYS.worker("edited"), _record(), 5)
    reborn = _kv(KEYS.worker("reborn"), _record(), 6)
    first = view.resync([stay, gone, went, edited, reborn, _kv(KEYS.device("stay", 0), b"{}", 2)], 6)
    assert sorted(_kinds(first)) == sorted(
        [("registered", w, kv.create_revision)
         for w, kv in [("stay", stay), ("gone", gone), ("went", went), ("edited", edited), ("reborn", reborn)]])
    assert all(c.revision == 6 for c in first)

    new = _kv(KEYS.worker("new"), _record(), 20)
    edited2 = _kv(KEYS.worker("edited"), _record("draining"), 5, 21, version=2)
    reborn2 = _kv(KEYS.worker("reborn"), _record(), 22)
    changes = view.resync([stay, new, edited2, reborn2], 30)
    assert _kinds(changes) == [
        ("lost", "gone", 3),
        ("lost", "reborn", 6),
        ("left", "went", 4),
        ("updated", "edited", 5),
        ("registered", "new", 20),
        ("registered", "reborn", 22),
    ]
    assert all(c.revision == 30 for c in changes)
    assert sorted(view.workers) == ["edited", "new", "reborn", "stay"]
    assert view.revision == 30
    assert view.resync([stay, new, edited2, reborn2], 31) == []


# --- property: watching and re-reading agree --------------------------------------------------


@dataclass
class FakeEtcd:
    """A tiny model of etcd's key space that emits watch events with prev values."""

    rev: int = 1
    kvs: dict[str, KeyValue] = field(default_factory=dict)
    next_lease: int = 0x1000

    def put(self, key: str, value: bytes, lease: int | None = None) -> WatchEvent:
        self.rev += 1
        prev = self.kvs.get(key)
        if prev is None:
            self.next_lease += 1
            kv = KeyValue(key, value, self.rev, self.rev, 1, lease if lease is not None else self.next_lease)
        else:
            kv = KeyValue(key, value, prev.create_revision, self.rev, prev.version + 1,
                          prev.lease if lease is None else lease)
        self.kvs[key] = kv
        return WatchEvent("put", kv, prev)

    def delete(self, key: str) -> WatchEvent | None:
        prev = self.kvs.pop(key, None)
        if prev is None:
            return None  # etcd writes nothing and emits nothing
        self.rev += 1
        return WatchEvent("delete", KeyValue(key, b"", 0, self.rev, 0, 0), prev)


WORKERS = ["w0", "w1", "w2"]
_ops = st.lists(
    st.tuples(
        st.sampled_from(["register", "leave", "expire", "noise"]),
        st.sampled_from(WORKERS),
        st.booleans(),  # close the watch batch after this operation
    ),
    max_size=40,
)


def _run(ops: list[tuple[str, str, bool]]) -> tuple[FakeEtcd, list[WatchBatch]]:
    etcd = FakeEtcd()
    batches = [WatchBatch(revision=etcd.rev, events=[])]  # the "watch established" batch
    pending: list[WatchEvent] = []
    for n, (op, worker, flush) in enumerate(ops):
        key = KEYS.worker(worker)
        events: list[WatchEvent | None] = []
        if op == "register":  # a new incarnation, or a record update of the live one
            events.append(etcd.put(key, _record(seq=n)))
        elif op == "leave":
            if key in etcd.kvs:
                events.append(etcd.put(key, _record("leaving", seq=n)))
            events.append(etcd.delete(key))
        elif op == "expire":
            events.append(etcd.delete(key))
        else:  # keys the view must ignore
            events.append(etcd.put(KEYS.device(worker, n % 2), b"{}"))
            events.append(etcd.put(KEYS.workers + worker + "/sub", b"{}"))
        pending.extend(e for e in events if e is not None)
        if flush or n == len(ops) - 1:
            batches.append(WatchBatch(revision=etcd.rev, events=pending))
            pending = []
    return etcd, batches


def _check_well_formed(changes: list[MembershipChange], final: dict[str, WorkerInfo],
                       start: dict[str, WorkerInfo] | None = None) -> None:
    """Per worker: registered, then updates, then one lost/left, for each incarnation."""
    live: dict[str, int] = {w: i.incarnation for w, i in (start or {}).items()}
    for c in changes:
        if c.kind == "registered":
            assert c.worker not in live, c
            live[c.worker] = c.info.incarnation
        else:
            assert live.get(c.worker) == c.info.incarnation, c
            if c.kind in ("lost", "left"):
                del live[c.worker]
    assert live == {w: i.incarnation for w, i in final.items()}


@settings(max_examples=150, deadline=None)
@given(ops=_ops, split=st.integers(min_value=0, max_value=40))
def test_watch_events_and_resync_agree(ops: list[tuple[str, str, bool]], split: int) -> None:
    etcd, batches = _run(ops)
    final_kvs = list(etcd.kvs.values())

    watched = MembershipView(KEYS)
    changes = [c for b in batches for c in watched.apply(b)]
    reread = MembershipView(KEYS)
    reread.resync(final_kvs, etcd.rev)
    assert watched.workers == reread.workers
    assert watched.revision == reread.revision == etcd.rev
    _check_well_formed(changes, watched.workers)

    # Watching part of the history, then re-reading (as after a compaction), agrees too.
    mixed = MembershipView(KEYS)
    for b in batches[:split]:
        mixed.apply(b)
    before = dict(mixed.workers)
    _check_well_formed(mixed.resync(final_kvs, etcd.rev), mixed.workers, start=before)
    assert mixed.workers == reread.workers


def test_a_read_etcd_refuses_ends_the_watch_through_on_failure_not_a_dead_thread() -> None:
    # A membership read past gRPC's 4 MiB response limit fails with RESOURCE_EXHAUSTED, an error no retry mends:
    # the monitor must say so (the coordinator steps down on it), not end its thread with nobody told.
    class Refusing(MemoryStore):
        def get_prefix(self, prefix: str) -> Any:
            raise StoreError("get_prefix: RESOURCE_EXHAUSTED received message larger than max")

    failures: list[BaseException] = []
    told = threading.Event()
    monitor = MembershipMonitor(Refusing(), Keys("t"), lambda change: None,
                                on_failure=lambda exc: (failures.append(exc), told.set()))
    monitor.start()
    try:
        assert told.wait(5.0), "the monitor's thread ended without on_failure"
    finally:
        monitor.stop()
    assert "RESOURCE_EXHAUSTED" in str(failures[0])
