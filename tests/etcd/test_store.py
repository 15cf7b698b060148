"""Tests for the store: EtcdStore (etcd/etcd_store.py) against a real etcd, and prefix_end (etcd/store.py)."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rallypoint.basics.errors import (
    LeaseNotFound,
    StoreError,
    StoreUnavailable,
    WatchCompacted,
    WriteIndeterminate,
)
from rallypoint.etcd.server import EtcdCluster
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.store import (
    Delete,
    Get,
    Put,
    WatchBatch,
    WatchEvent,
    created_at,
    key_exists,
    key_missing,
    prefix_end,
    unchanged_since,
)

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
_WAIT_S = 5.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    c = EtcdCluster.start(members=1, base_dir=tmp_path_factory.mktemp("store") / "etcd")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def store(cluster: EtcdCluster) -> Iterator[EtcdStore]:
    s = EtcdStore(cluster.endpoints, request_timeout_s=2.0)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def pfx() -> str:
    """A key prefix no other test writes under."""
    return f"/t/{uuid.uuid4().hex[:10]}/"


class WatchReader:
    """Drains an open watch from a daemon thread, so a test can wait with a timeout."""

    def __init__(self, store: EtcdStore, prefix: str, start_revision: int) -> None:
        self.watch = store.watch_prefix(prefix, start_revision)
        self._items: queue.Queue[WatchBatch | BaseException | None] = queue.Queue()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        try:
            for batch in self.watch:
                self._items.put(batch)
        except BaseException as exc:  # handed to the test thread
            self._items.put(exc)
            return
        self._items.put(None)

    def next_item(self, timeout_s: float = _WAIT_S) -> WatchBatch | BaseException | None:
        return self._items.get(timeout=timeout_s)

    def next_batch(self, timeout_s: float = _WAIT_S) -> WatchBatch:
        item = self.next_item(timeout_s)
        assert isinstance(item, WatchBatch), f"expected a batch, got {item!r}"
        return item

    def events(self, count: int, timeout_s: float = _WAIT_S) -> list[WatchEvent]:
        """The next ``count`` events, across however many batches carry them."""
        deadline = time.monotonic() + timeout_s
        out: list[WatchEvent] = []
        while len(out) < count:
            batch = self.next_batch(max(0.01, deadline - time.monotonic()))
            assert all(e.kv.mod_revision <= batch.revision for e in batch.events)
            out.extend(batch.events)
        assert len(out) == count, f"got more events than expected: {out}"
        return out

    def close(self) -> None:
        self.watch.cancel()
        self._thread.join(timeout=_WAIT_S)
        assert not self._thread.is_alive()


def _eventually(fn: Callable[[], T], within_s: float = 15.0) -> T:
    """Call ``fn`` until it stops raising StoreError; re-raise after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return fn()
        except StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# --- prefix_end (pure) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "end"),
    [
        (b"/a/", b"/a0"),
        (b"a", b"b"),
        (b"a\xff", b"b"),
        (b"a\xfe", b"a\xff"),
        (b"\xff\xff", b"\0"),
        (b"", b"\0"),
    ],
)
def test_prefix_end_examples(prefix: bytes, end: bytes) -> None:
    assert prefix_end(prefix) == end


@given(prefix=st.binary(min_size=1, max_size=6), key=st.binary(max_size=8))
def test_prefix_end_bounds_exactly_the_keys_with_the_prefix(prefix: bytes, key: bytes) -> None:
    end = prefix_end(prefix)
    in_range = key >= prefix and (end == b"\0" or key < end)
    assert in_range == key.startswith(prefix)


# --- key/value ----------------------------------------------------------------------------


def test_put_get_delete_round_trip(store: EtcdStore, pfx: str) -> None:
    key = pfx + "k"
    assert store.get(key) is None
    rev1 = store.put(key, "v1")
    kv = store.get(key)
    assert kv is not None
    assert (kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease) == (
        key, b"v1", rev1, rev1, 1, 0)
    rev2 = store.put(key, b"{\"n\": 2}")
    kv2 = store.get(key)
    assert kv2 is not None
    assert rev2 > rev1
    assert (kv2.create_revision, kv2.mod_revision, kv2.version) == (rev1, rev2, 2)
    assert kv2.json() == {"n": 2}
    assert store.revision() >= rev2
    assert store.delete(key) == 1
    assert store.get(key) is None
    assert store.delete(key) == 0


def test_get_prefix_is_isolated_and_ordered(store: EtcdStore, pfx: str) -> None:
    store.put(pfx + "a/2", "x")
    store.put(pfx + "a/1", "y")
    store.put(pfx + "ab", "not under a/")
    last = store.put(pfx + "a", "not under a/ either")
    kvs, rev = store.get_prefix(pfx + "a/")
    assert [kv.key for kv in kvs] == [pfx + "a/1", pfx + "a/2"]
    assert rev >= last
    assert store.get_prefix(pfx + "zz/") == ([], store.revision())


def test_delete_prefix_removes_only_the_prefix(store: EtcdStore, pfx: str) -> None:
    for k in ("a/1", "a/2", "ab"):
        store.put(pfx + k, "v")
    assert store.delete(pfx + "a/", prefix=True) == 2
    kvs, _ = store.get_prefix(pfx)
    assert [kv.key for kv in kvs] == [pfx + "ab"]


# --- transactions ---------------------------------------------------------------------------


def test_txn_key_missing_success_then_failure(store: EtcdStore, pfx: str) -> None:
    key = pfx + "k"
    first = store.txn([key_missing(key)], [Put(key, "mine"), Get(key)], [Get(key)])
    assert first.succeeded
    assert len(first.reads) == 1 and len(first.reads[0]) == 1
    created = first.reads[0][0]
    assert created.value == b"mine"
    assert created.create_revision == created.mod_revision == first.revision

    second = store.txn([key_missing(key)], [Put(key, "theirs")], [Get(key)])
    assert not second.succeeded
    assert second.revision == first.revision  # nothing was written
    assert second.reads == [[created]]
    kv = store.get(key)
    assert kv is not None and kv.value == b"mine"


def test_txn_created_at_guards_the_incarnation(store: EtcdStore, pfx: str) -> None:
    key = pfx + "worker"
    inc = store.put(key, "a")
    store.put(key, "b")  # an update keeps the create revision
    ok = store.txn([created_at(key, inc), key_exists(key)], [Put(pfx + "side", "1")])
    assert ok.succeeded
    stale = store.txn([created_at(key, inc - 1)], [Put(pfx + "side", "2")], [Get(pfx + "side")])
    assert not stale.succeeded
    assert [kv.value for kv in stale.reads[0]] == [b"1"]
    store.delete(key)
    inc2 = store.put(key, "c")  # a new incarnation
    assert not store.txn([created_at(key, inc)], [Put(pfx + "side", "3")]).succeeded
    assert store.txn([created_at(key, inc2)], []).succeeded


def test_txn_unchanged_since(store: EtcdStore, pfx: str) -> None:
    key = pfx + "k"
    mod = store.put(key, "1")
    ok = store.txn([unchanged_since(key, mod)], [Put(key, "2")])
    assert ok.succeeded and ok.revision > mod
    lost_race = store.txn([unchanged_since(key, mod)], [Put(key, "3")], [Get(key)])
    assert not lost_race.succeeded
    assert lost_race.reads[0][0].value == b"2"
    assert lost_race.reads[0][0].mod_revision == ok.revision


def test_txn_reads_follow_op_order_and_prefix(store: EtcdStore, pfx: str) -> None:
    store.put(pfx + "d/1", "a")
    store.put(pfx + "d/2", "b")
    r = store.txn([], [Get(pfx + "d/", prefix=True), Delete(pfx + "d/1"), Get(pfx + "d/", prefix=True),
                       Get(pfx + "missing")])
    assert r.succeeded
    assert [[kv.key for kv in read] for read in r.reads] == [[pfx + "d/1", pfx + "d/2"], [pfx + "d/2"], []]
    assert store.revision() == r.revision


# --- leases ---------------------------------------------------------------------------------


def test_lease_grant_keepalive_revoke(store: EtcdStore, pfx: str) -> None:
    grant = store.grant_lease(5)
    assert grant.id > 0 and grant.ttl_s == 5
    assert store.keepalive(grant.id) == 5
    assert 0 < store.lease_ttl(grant.id) <= 5
    store.put(pfx + "a", "1", lease=grant.id)
    store.txn([], [Put(pfx + "b", "2", lease=grant.id)])
    store.put(pfx + "free", "3")
    kv = store.get(pfx + "a")
    assert kv is not None and kv.lease == grant.id

    store.revoke_lease(grant.id)
    kvs, _ = store.get_prefix(pfx)
    assert [kv.key for kv in kvs] == [pfx + "free"]
    assert store.keepalive(grant.id) == 0
    assert store.lease_ttl(grant.id) == -1
    store.revoke_lease(grant.id)  # revoking a lease already gone is not an error


def test_lease_ttl_of_unknown_lease_is_minus_one(store: EtcdStore) -> None:
    assert store.lease_ttl(0x7A5E_0000_0001) == -1


def test_put_with_revoked_lease_raises_lease_not_found(store: EtcdStore, pfx: str) -> None:
    grant = store.grant_lease(5)
    store.revoke_lease(grant.id)
    with pytest.raises(LeaseNotFound) as info:
        store.put(pfx + "k", "v", lease=grant.id)
    assert info.value.lease_id == grant.id
    assert store.get(pfx + "k") is None


# --- watches --------------------------------------------------------------------------------


def test_watch_delivers_established_then_put_and_delete(store: EtcdStore, pfx: str) -> None:
    start = store.revision() + 1
    reader = WatchReader(store, pfx + "w/", start)
    try:
        established = reader.next_batch()
        assert established.events == []
        assert established.revision >= start - 1

        r1 = store.put(pfx + "w/a", "1")
        store.put(pfx + "wx", "outside the prefix")
        r2 = store.put(pfx + "w/a", "2")
        r3 = store.delete(pfx + "w/a")
        assert r3 == 1
        put1, put2, delete = reader.events(3)
        assert (put1.type, put1.kv.value, put1.kv.mod_revision, put1.prev) == ("put", b"1", r1, None)
        assert put2.type == "put" and put2.kv.mod_revision == r2
        assert put2.prev is not None and put2.prev.value == b"1"
        assert delete.type == "delete" and delete.kv.key == pfx + "w/a"
        assert delete.kv.mod_revision > r2
        assert delete.prev is not None
        assert (delete.prev.value, delete.prev.create_revision, delete.prev.mod_revision) == (b"2", r1, r2)
    finally:
        reader.close()


def test_watch_resumes_from_exactly_the_requested_revision(store: EtcdStore, pfx: str) -> None:
    r1 = store.put(pfx + "a", "1")
    r2 = store.put(pfx + "b", "2")
    store.delete(pfx + "a")
    r4 = store.put(pfx + "b", "3")
    reader = WatchReader(store, pfx, r2)
    try:
        assert reader.next_batch().events == []
        events = reader.events(3)
        assert [(e.type, e.kv.key) for e in events] == [
            ("put", pfx + "b"), ("delete", pfx + "a"), ("put", pfx + "b")]
        assert events[0].kv.mod_revision == r2
        assert events[2].kv.mod_revision == r4
        assert all(e.kv.mod_revision != r1 for e in events)
        assert events[1].prev is not None and events[1].prev.value == b"1"
    finally:
        reader.close()


def test_watch_from_compacted_revision_raises(store: EtcdStore, pfx: str) -> None:
    old = store.put(pfx + "k", "1")
    store.put(pfx + "k", "2")
    now = store.put(pfx + "k", "3")
    store.compact(now)
    reader = WatchReader(store, pfx, old)
    try:
        item = reader.next_item()
        if isinstance(item, WatchBatch):  # etcd may confirm the watch before cancelling it
            assert item.events == []
            item = reader.next_item()
        assert isinstance(item, WatchCompacted), f"expected WatchCompacted, got {item!r}"
        assert item.requested_revision == old
        assert item.compact_revision == now
    finally:
        reader.close()
    # From the compaction point on, history is still there.
    ok = WatchReader(store, pfx, now)
    try:
        assert ok.next_batch().events == []
        (event,) = ok.events(1)
        assert event.kv.mod_revision == now and event.kv.value == b"3"
    finally:
        ok.close()


def test_watch_cancel_ends_iteration_quietly(store: EtcdStore, pfx: str) -> None:
    reader = WatchReader(store, pfx, store.revision() + 1)
    assert reader.next_batch().events == []
    reader.watch.cancel()
    assert reader.next_item() is None  # iteration ended without an error
    reader.close()


# --- etcd down and back ------------------------------------------------------------------------


@pytest.mark.processes
def test_outage_reads_unavailable_writes_indeterminate_then_recovers(tmp_path: Path) -> None:
    assert issubclass(WriteIndeterminate, StoreUnavailable)  # callers retry both as transient
    cluster = EtcdCluster.start(members=1, base_dir=tmp_path / "etcd")
    store = EtcdStore(cluster.endpoints, request_timeout_s=1.0)
    try:
        before = store.put("/t/outage/k", "kept")
        cluster.stop_member(0)

        with pytest.raises(StoreUnavailable) as read_err:
            store.get("/t/outage/k")
        assert not isinstance(read_err.value, WriteIndeterminate)
        with pytest.raises(WriteIndeterminate):
            store.put("/t/outage/k", "maybe")
        with pytest.raises(WriteIndeterminate):
            store.txn([], [Put("/t/outage/t", "maybe")])
        with pytest.raises(StoreUnavailable):
            store.keepalive(1)

        cluster.start_member(0)
        began = time.monotonic()
        kv = _eventually(lambda: store.get("/t/outage/k"), within_s=10.0)
        assert time.monotonic() - began < 10.0
        assert kv is not None and kv.value == b"kept" and kv.mod_revision == before
        after = _eventually(lambda: store.put("/t/outage/k", "again"), within_s=10.0)
        assert after > before
    finally:
        store.close()
        cluster.stop()
