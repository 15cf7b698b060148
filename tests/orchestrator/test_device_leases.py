"""Device leases against a real etcd: compare-and-swap only, races, cordon, release."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest

from rallypoint.chaos.invariants import check_exclusive_device_leases
from rallypoint.orchestrator.control.devices import DeviceLeases, Placement, free_worker
from rallypoint.etcd.cluster_view import Holder, read_cluster
from rallypoint.basics.errors import AllocationError, NoSpareDevices, UnknownWorker
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.store import KeyValue, WatchEvent
from rallypoint.workers.registration import try_register

KEYS = Keys("t")


def register(store: EtcdStore, worker: str, devices: int) -> tuple[int, int]:
    """A lightweight worker: registered through the worker's own code path; returns (incarnation, lease)."""
    lease = store.grant_lease(30).id
    incarnation, _ = try_register(
        store, KEYS, worker, {"worker": worker, "address": "", "pid": 0, "devices": devices, "state": "serving"},
        [{"index": i} for i in range(devices)], lease,
    )
    assert incarnation is not None
    return incarnation, lease


class History:
    """Every event under leases/ from a revision on, recorded by a real watch."""

    def __init__(self, store: EtcdStore, start_revision: int) -> None:
        self.events: list[WatchEvent] = []
        self._watch = store.watch_prefix(KEYS.leases, start_revision)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for batch in self._watch:
            self.events.extend(batch.events)

    def until(self, revision: int) -> list[WatchEvent]:
        deadline = threading.Event()
        for _ in range(200):
            if self.events and self.events[-1].kv.mod_revision >= revision:
                break
            deadline.wait(0.02)
        self._watch.cancel()
        self._thread.join(timeout=5)
        return self.events


@pytest.fixture
def history(store: EtcdStore) -> Iterator[History]:
    yield History(store, store.revision() + 1)


def test_many_concurrent_allocators_never_hand_out_a_device_twice(store: EtcdStore, history: History) -> None:
    for w in range(6):
        register(store, f"w{w}", 4)  # 24 devices
    held: dict[tuple[str, int], Placement] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def allocator(n: int) -> None:
        rng = random.Random(n)
        leases = DeviceLeases(store, KEYS, exclusive=False)  # as if each were its own process: only the CAS orders them
        mine: list[Placement] = []
        try:
            for step in range(12):
                if mine and rng.random() < 0.3:
                    p = mine.pop(rng.randrange(len(mine)))
                    with lock:
                        for d in p.devices:
                            del held[(p.worker, d)]
                    assert leases.release(p.job, p.slice) == len(p.devices)
                    continue
                try:
                    p = leases.allocate(f"job{n}", f"s{step}", rng.choice([1, 1, 2, 3]))
                except (NoSpareDevices, AllocationError):
                    continue
                with lock:
                    for d in p.devices:
                        assert (p.worker, d) not in held, f"{(p.worker, d)} handed to {p} while held by {held[(p.worker, d)]}"
                        held[(p.worker, d)] = p
                mine.append(p)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=allocator, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # Final state: exactly the devices the allocators believe they hold, with those holders.
    snap = read_cluster(store, KEYS)
    final = {(w, d): h for w, s in snap.workers.items() for d, h in s.holders.items()}
    assert set(final) == set(held)
    for dev, p in held.items():
        assert (final[dev].job, final[dev].slice) == (p.job, p.slice)
    # History: no lease key was ever written while held.
    events = history.until(snap.revision)
    assert len(events) > 50, "the race did not exercise enough allocations"
    assert check_exclusive_device_leases(events) == []


def test_the_history_check_catches_a_device_handed_over_while_held() -> None:
    def ev(kind: str, version: int, rev: int, value: bytes) -> WatchEvent:
        kv = KeyValue(KEYS.lease("w0", 0), value, create_revision=rev, mod_revision=rev, version=version, lease=1)
        return WatchEvent(kind, kv, None)  # type: ignore[arg-type]

    ok = [ev("put", 1, 10, b"a"), ev("delete", 0, 11, b""), ev("put", 1, 12, b"b")]
    assert check_exclusive_device_leases(ok) == []
    bad = [ev("put", 1, 10, b"a"), ev("put", 2, 11, b"b")]
    [v] = check_exclusive_device_leases(bad)
    assert v.key == KEYS.lease("w0", 0) and v.revision == 11


def test_cordoned_worker_gets_no_new_leases_and_keeps_its_old_ones(store: EtcdStore) -> None:
    register(store, "w0", 2)
    register(store, "w1", 2)
    leases = DeviceLeases(store, KEYS)
    first = leases.allocate("j", "a", 1)
    leases.cordon(first.worker)
    other = "w1" if first.worker == "w0" else "w0"
    second = leases.allocate("j", "b", 2)
    assert second.worker == other
    with pytest.raises(NoSpareDevices, match="uncordon"):
        leases.allocate("j", "c", 1)  # only the cordoned worker has a free device
    snap = read_cluster(store, KEYS)
    assert snap.workers[first.worker].state == "cordoned"
    assert list(snap.workers[first.worker].holders) == list(first.devices)
    assert leases.uncordon(first.worker) is True
    third = leases.allocate("j", "c", 1)
    assert third.worker == first.worker


def test_an_allocation_racing_a_cordon_cannot_land_after_it(store: EtcdStore) -> None:
    inc, lease = register(store, "w0", 2)
    leases = DeviceLeases(store, KEYS)
    # An allocator read the cluster before the cordon and writes after it: its compare fails.
    snap = read_cluster(store, KEYS)
    leases.cordon("w0")
    from rallypoint.etcd.store import Put, created_at, key_missing

    r = store.txn(
        [created_at(KEYS.worker("w0"), inc), key_missing(KEYS.cordon("w0")), key_missing(KEYS.lease("w0", 0))],
        [Put(KEYS.lease("w0", 0), Holder("j", "s", "n").to_json(), lease=lease)],
    )
    assert snap.workers["w0"].state == "spare"
    assert not r.succeeded
    assert store.get(KEYS.lease("w0", 0)) is None


def test_release_on_request_on_job_end_and_on_worker_loss(store: EtcdStore) -> None:
    register(store, "w0", 2)
    _, lease1 = register(store, "w1", 2)
    leases = DeviceLeases(store, KEYS)
    a = leases.allocate("j1", "a", 1)
    b = leases.allocate("j1", "b", 1)
    leases.allocate("j2", "a", 2)
    assert leases.release("j1", "a") == 1  # one slice, on request
    assert leases.release("j1") == 1  # the rest of the job, at its end
    assert leases.release("j1") == 0
    snap = read_cluster(store, KEYS)
    assert {h.job for s in snap.workers.values() for h in s.holders.values()} == {"j2"}
    # Fencing a worker (revoking its lease) deletes its registration; its device leases are the leader's (on the
    # leader's lease), which the leader deletes when it sees the worker gone.
    j2_worker = next(w for w, s in snap.workers.items() if s.holders)
    store.revoke_lease(snap.workers[j2_worker].info.lease)
    snap = read_cluster(store, KEYS)
    assert j2_worker not in snap.workers
    assert free_worker(store, KEYS, store.txn, j2_worker, snap.revision + 1) == 2
    assert store.get_prefix(KEYS.worker_leases(j2_worker))[0] == []
    assert a.worker and b.worker and lease1


def test_allocation_checks_the_incarnation(store: EtcdStore) -> None:
    register(store, "w0", 1)
    snap = read_cluster(store, KEYS)
    old = snap.workers["w0"].info
    store.revoke_lease(old.lease)
    inc, _ = register(store, "w0", 1)  # a new incarnation of the same id
    assert inc > old.incarnation
    from rallypoint.etcd.store import Put, created_at, key_missing

    r = store.txn(
        [created_at(KEYS.worker("w0"), old.incarnation), key_missing(KEYS.lease("w0", 0))],
        [Put(KEYS.lease("w0", 0), Holder("j", "s", "n").to_json())],
    )
    assert not r.succeeded, "a lease for a dead incarnation was written"


def test_unknown_worker_and_bad_requests_are_refused_clearly(store: EtcdStore) -> None:
    register(store, "w0", 1)
    leases = DeviceLeases(store, KEYS)
    with pytest.raises(UnknownWorker, match="rallypoint workers"):
        leases.cordon("nope")
    with pytest.raises(AllocationError, match="at least 1"):
        leases.allocate("j", "s", 0)
    with pytest.raises(NoSpareDevices, match="largest free: 1"):
        leases.allocate("j", "s", 2)
    assert store.get_prefix(KEYS.leases)[0] == []
    assert store.get(KEYS.cordon("nope")) is None


# -- gangs: a multi-host slice's devices on several workers, in one transaction ---------------------------------------


def test_a_slice_larger_than_any_worker_is_leased_as_a_gang_in_one_transaction(store: EtcdStore) -> None:
    for w in ("w0", "w1", "w2"):
        register(store, w, 4)
    leases = DeviceLeases(store, KEYS)
    leases.allocate("other", "s", 2)  # w0 (by name) is now partly leased: a gang packs onto it first
    gang = leases.allocate_gang("big", "stage0", 4)
    # The fewest members that fit, each giving as many devices, listed by name (their process ids).
    assert [(p.worker, p.devices) for p in gang] == [("w0", (2, 3)), ("w1", (0, 1))]
    kvs, _ = store.get_prefix(KEYS.leases)
    mine = [kv for kv in kvs if Holder.from_json(kv.value).job == "big"]
    assert len(mine) == 4 and len({kv.mod_revision for kv in mine}) == 1, "the gang took more than one transaction"
    assert len({Holder.from_json(kv.value).nonce for kv in mine}) == 1
    # Eight devices on workers of 4: two whole workers. Nothing is left for another 8.
    register(store, "w3", 4)
    eight = leases.allocate_gang("huge", "s", 6)
    assert sorted(p.worker for p in eight) == ["w2", "w3"] and all(len(p.devices) == 3 for p in eight)
    with pytest.raises(NoSpareDevices) as err:
        leases.allocate_gang("none", "s", 8)
    assert "slice 's' of job 'none'" in str(err.value)


def test_a_gang_whose_member_lost_a_device_meanwhile_leases_nothing_at_all(store: EtcdStore) -> None:
    for w in ("w0", "w1"):
        register(store, w, 2)
    leases = DeviceLeases(store, KEYS)
    snap = read_cluster(store, KEYS)  # the allocator decided on this view...
    leases.lease("racer", "s", "w1", [1])  # ...then another allocator took one device of the second member
    holder = Holder(job="big", slice="s", nonce="n", term=0)
    assert leases.lease_gang(snap, holder, [("w0", [0, 1]), ("w1", [0, 1])]) is None
    kvs, _ = store.get_prefix(KEYS.leases)
    assert [Holder.from_json(kv.value).job for kv in kvs] == ["racer"], "half a gang was leased"


def test_choose_gang_keeps_one_platform_and_equal_shares(store: EtcdStore) -> None:
    from rallypoint.orchestrator.control.devices import choose_gang

    for w in ("a", "b", "c"):
        register(store, w, 3)
    snap = read_cluster(store, KEYS)
    assert choose_gang(snap, 5) is None  # 5 devices split into equal shares only as 5 x 1: fewer workers here
    assert [len(d) for _, d in choose_gang(snap, 6) or []] == [3, 3]
    assert [len(d) for _, d in choose_gang(snap, 9) or []] == [3, 3, 3]
    assert choose_gang(snap, 6, exclude=frozenset({"a", "b"})) is None


def test_a_job_holding_more_devices_than_one_etcd_transaction_allows_is_released_whole(store: EtcdStore) -> None:
    # etcd refuses a transaction of more than 128 compares: release goes in chunks.
    for w in ("w0", "w1"):
        register(store, w, 70)
    leases = DeviceLeases(store, KEYS)
    leases.allocate("big", "a", 70)
    leases.allocate("big", "b", 70)
    assert leases.release("big") == 140
    kvs, _ = store.get_prefix(KEYS.leases)
    assert kvs == []


def test_a_gang_past_etcds_transaction_limit_is_refused_by_name_and_leases_nothing(store: EtcdStore) -> None:
    for w in range(14):
        register(store, f"w{w:02d}", 8)
    with pytest.raises(AllocationError) as err:
        DeviceLeases(store, KEYS).allocate_gang("big", "stage0", 112)  # 14 x 8: 141 compares
    assert "needs 141 compares" in str(err.value) and "--max-txn-ops" in str(err.value)
    kvs, _ = store.get_prefix(KEYS.leases)
    assert kvs == []


def test_jobs_placed_at_once_on_one_leader_all_get_their_devices(store: EtcdStore) -> None:
    # Sixteen jobs of 12 one-device slices placed at once by one leader (a DeviceLeases per job, as JobTerm holds):
    # each allocator ranks the same snapshot the same way, so without order among them most attempts lose their
    # race, and a slice ran out of attempts ("other allocators kept winning") with devices to spare.
    for w in range(12):
        register(store, f"w{w}", 20)  # 240 devices for 192 slices
    placed: dict[str, list[Placement]] = {}
    errors: list[BaseException] = []

    def place(job: str) -> None:
        leases = DeviceLeases(store, KEYS)
        try:
            placed[job] = [leases.allocate(job, f"s{i}", 1) for i in range(12)]
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=place, args=(f"job{n}",)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    devices = [(p.worker, d) for ps in placed.values() for p in ps for d in p.devices]
    assert len(devices) == len(set(devices)) == 192
