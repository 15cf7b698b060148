"""Device leases and the spare pool.

A physical device ``(worker, index)`` is handed to a ``(job, virtual slice)``
only by an etcd transaction that creates its ``leases/<worker>/<index>`` key if
and only if: the key does not exist, the worker is still the same incarnation,
and the worker is not cordoned (plus the leader's term, when the allocator is
the leader). There is no read-modify-write: two allocators racing for a device
cannot both win, because one of their transactions sees the key already there.

Lease keys are attached to the *leader's* etcd lease (a worker's etcd user may write no
``leases/`` key, and etcd lets a worker revoke or put on its own lease only while every key on
it is the worker's own: :mod:`rallypoint.etcd.auth`). So the leader frees a worker's devices
itself: when it sees the worker lost or leaving (its registration deleted), it deletes the
worker's ``leases/<worker>/`` keys made before (:func:`free_worker`); and when the leader's
term ends with its lease, every device lease goes with it (a new leader adopts the jobs and
leases their devices again).

A **spare** is a live, uncordoned worker none of whose devices is leased.
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rallypoint.basics.clock import SYSTEM_CLOCK, Clock
from rallypoint.basics.errors import AllocationError, NoSpareDevices, StoreError, UnknownWorker, WriteIndeterminate
from rallypoint.etcd.cluster_view import ClusterSnapshot, Holder, read_cluster
from rallypoint.etcd.keys import Keys, check_name
from rallypoint.etcd.records import skip_bad
from rallypoint.etcd.store import (MAX_TXN_OPS, TXN_OPS, Compare, Delete, Get, KeyValue, Op, Put, Store, TxnResult,
                                   created_at, key_missing, unchanged_since)

FencedTxn = Callable[[Sequence[Compare], Sequence[Op], Sequence[Op]], TxnResult]


def choose_devices(snapshot: ClusterSnapshot, count: int, *, exclude: frozenset[str] = frozenset()) -> tuple[str, list[int]] | None:
    """Placement policy: which worker's devices a slice of ``count`` devices gets.

    Only live, uncordoned workers with ``count`` free devices qualify. Workers
    already partly leased come first (pack), then the tightest fit, then the
    name, so whole free workers stay spares as long as possible.
    """
    candidates = [
        s for w, s in snapshot.workers.items()
        if w not in exclude and not s.cordoned and s.info.state != "leaving" and len(s.free) >= count
    ]
    if not candidates:
        return None
    best = min(candidates, key=lambda s: (not s.holders, len(s.free), s.info.worker))
    return best.info.worker, best.free[:count]


def choose_gang(snapshot: ClusterSnapshot, count: int, *, exclude: frozenset[str] = frozenset(),
                max_members: int = 64) -> list[tuple[str, list[int]]] | None:
    """Placement policy for a multi-host slice: ``count`` devices as a gang of workers (docs/multihost.md).

    A gang has the fewest members that can hold the slice, each giving the same number of
    devices (``count / members``: the global mesh is a regular grid of hosts), all of one
    platform and device kind. Within that, workers are taken as :func:`choose_devices`
    ranks them (partly leased first, then the tightest fit, then the name), and the gang is
    listed by worker name: that order is the members' process ids. None when no gang fits.
    """
    candidates = [
        s for w, s in snapshot.workers.items()
        if w not in exclude and not s.cordoned and s.info.state != "leaving" and s.free
    ]
    for members in range(2, min(count, max_members) + 1):
        if count % members:
            continue
        each = count // members
        kinds: dict[tuple[str, str], list[Any]] = {}
        for s in candidates:
            if len(s.free) >= each:
                kinds.setdefault((s.info.platform, s.info.device_kind), []).append(s)
        fits = [sorted(group, key=lambda s: (not s.holders, len(s.free), s.info.worker))[:members]
                for group in kinds.values() if len(group) >= members]
        if fits:
            best = min(fits, key=lambda g: [(not s.holders, len(s.free), s.info.worker) for s in g])
            return sorted(((s.info.worker, s.free[:each]) for s in best), key=lambda m: m[0])
    return None


_PLACING: dict[str, threading.Lock] = {}
_PLACING_GUARD = threading.Lock()


def _placing(cluster: str) -> threading.Lock:
    """The lock one process's allocations in ``cluster`` take turns on (one leader's jobs, one at a time)."""
    with _PLACING_GUARD:
        return _PLACING.setdefault(cluster, threading.Lock())


@dataclass(frozen=True, slots=True)
class Placement:
    """Devices leased to one virtual slice."""

    job: str
    slice: str
    worker: str
    incarnation: int
    devices: tuple[int, ...]
    revision: int


class DeviceLeases:
    """Allocates and releases device leases with compare-and-swap transactions.

    Args:
        store: the coordination store.
        keys: the cluster's key schema.
        fenced_txn: when given (the leader's :meth:`LeaderElection.fenced_txn`),
            every write also requires the leader's term.
        term: the leader term recorded in holders (0 when not fenced).
        clock: what a cordon's ``at`` is read from.
        exclusive: allocations by every ``DeviceLeases`` of this process in the cluster take turns (one
            leader places its jobs' slices one at a time). Each allocator ranks the same snapshot the same
            way, so allocators racing in one process mostly lose to each other: sixteen jobs placed at once
            ran slices out of attempts with devices to spare. The compare-and-swap still guards against
            another process (a deposed leader). False: race freely (a test of the compare-and-swap).
    """

    def __init__(self, store: Store, keys: Keys, *, fenced_txn: FencedTxn | None = None, term: int = 0,
                 clock: Clock = SYSTEM_CLOCK, lease: Callable[[], int] = lambda: 0, exclusive: bool = True) -> None:
        self._turn: threading.Lock | None = _placing(keys.cluster) if exclusive else None
        self.store = store
        self.lease_id = lease  # the etcd lease device leases are put on: the leader's (0: none, e.g. a test's)
        self.clock = clock
        self.keys = keys
        self._txn: FencedTxn = fenced_txn or store.txn
        self.term = term

    def allocate(self, job: str, slice_name: str, count: int, *, max_attempts: int = 16) -> Placement:
        """Lease ``count`` devices of one worker to ``(job, slice_name)``.

        Raises:
            NoSpareDevices: no live, uncordoned worker has ``count`` free devices.
            AllocationError: every attempt lost its race (heavy contention).
        """
        check_name("job", job)
        check_name("slice", slice_name)
        if count < 1:
            raise AllocationError(f"slice {slice_name!r} asks for {count} devices; it needs at least 1")
        holder = Holder(job=job, slice=slice_name, nonce=uuid.uuid4().hex, term=self.term)
        with self._turn or contextlib.nullcontext():
            return self._allocate(holder, count, max_attempts)

    def _allocate(self, holder: Holder, count: int, max_attempts: int) -> Placement:
        job, slice_name = holder.job, holder.slice
        for _ in range(max_attempts):
            snap = read_cluster(self.store, self.keys)
            choice = choose_devices(snap, count)
            if choice is None:
                largest = max((len(s.free) for s in snap.workers.values() if not s.cordoned), default=0)
                raise NoSpareDevices(job, slice_name, count, largest)
            placed = self._try_lease(snap, holder, *choice)
            if placed is not None:
                return placed
        raise AllocationError(
            f"could not lease {count} devices for slice {slice_name!r} of job {job!r} after "
            f"{max_attempts} attempts: other allocators kept winning; retry later"
        )

    def allocate_gang(self, job: str, slice_name: str, count: int, *, exclude: frozenset[str] = frozenset(),
                      max_attempts: int = 16) -> tuple[Placement, ...]:
        """Lease ``count`` devices on several workers to ``(job, slice_name)`` as one gang, all or nothing.

        Every member's devices are leased by **one** etcd transaction, which checks every
        member (its incarnation, not cordoned, each device free): never half a slice. The
        members come back in process-id order (:func:`choose_gang`).

        Raises:
            NoSpareDevices: no gang of live, uncordoned workers has ``count`` free devices.
            AllocationError: every attempt lost its race (heavy contention).
        """
        check_name("job", job)
        check_name("slice", slice_name)
        holder = Holder(job=job, slice=slice_name, nonce=uuid.uuid4().hex, term=self.term)
        with self._turn or contextlib.nullcontext():
            return self._allocate_gang(holder, count, exclude, max_attempts)

    def _allocate_gang(self, holder: Holder, count: int, exclude: frozenset[str],
                       max_attempts: int) -> tuple[Placement, ...]:
        job, slice_name = holder.job, holder.slice
        for _ in range(max_attempts):
            snap = read_cluster(self.store, self.keys)
            gang = choose_gang(snap, count, exclude=exclude)
            if gang is None:
                free = sum(len(s.free) for s in snap.workers.values() if not s.cordoned)
                raise NoSpareDevices(job, slice_name, count, free)
            placed = self.lease_gang(snap, holder, gang)
            if placed is not None:
                return placed
        raise AllocationError(
            f"could not lease a gang of {count} devices for slice {slice_name!r} of job {job!r} after "
            f"{max_attempts} attempts: other allocators kept winning; retry later")

    def lease_gang(self, snap: ClusterSnapshot, holder: Holder,
                   gang: Sequence[tuple[str, Sequence[int]]]) -> tuple[Placement, ...] | None:
        """One transaction for every member of ``gang`` (as ``snap`` saw them); None if it lost (nothing leased)."""
        need = sum(2 + len(d) for _, d in gang) + 1  # each member's guards and devices, and the leader's term
        if need > MAX_TXN_OPS:
            raise AllocationError(
                f"a gang of {len(gang)} workers and {sum(len(d) for _, d in gang)} devices for slice "
                f"{holder.slice!r} needs {need} compares in its one etcd transaction; etcd allows {MAX_TXN_OPS} "
                "(--max-txn-ops): ask for fewer devices per slice (docs/multihost.md)")
        compares: list[Compare] = []
        puts: list[Op] = []
        for worker, devices in gang:
            info = snap.workers[worker].info
            compares += [created_at(self.keys.worker(worker), info.incarnation), key_missing(self.keys.cordon(worker))]
            compares += [key_missing(self.keys.lease(worker, d)) for d in devices]
            puts += [Put(self.keys.lease(worker, d), holder.to_json(), lease=self.lease_id()) for d in devices]
        try:
            r = self._txn(compares, puts, [])
            applied, revision = r.succeeded, r.revision
        except WriteIndeterminate:
            applied, revision = True, 0
            for worker, devices in gang:
                mine, revision = self._ours(worker, list(devices), holder)
                applied = applied and mine
        if not applied:
            return None
        return tuple(Placement(holder.job, holder.slice, w, snap.workers[w].info.incarnation, tuple(d), revision)
                     for w, d in gang)

    def lease(self, job: str, slice_name: str, worker: str, devices: Sequence[int]) -> Placement | None:
        """Lease exactly ``devices`` of ``worker`` to ``(job, slice_name)`` (a remap decision).

        Returns None when the transaction lost: a device was taken, the worker is
        cordoned or is no longer the incarnation in a fresh snapshot; decide again.
        """
        holder = Holder(job=check_name("job", job), slice=check_name("slice", slice_name), nonce=uuid.uuid4().hex,
                        term=self.term)
        snap = read_cluster(self.store, self.keys)
        if worker not in snap.workers:
            return None
        return self._try_lease(snap, holder, worker, list(devices))

    def _try_lease(self, snap: ClusterSnapshot, holder: Holder, worker: str, devices: list[int]) -> Placement | None:
        """One compare-and-swap: ``devices`` of ``worker`` (as ``snap`` saw it) to ``holder``; None if it lost."""
        info = snap.workers[worker].info
        compares = [created_at(self.keys.worker(worker), info.incarnation), key_missing(self.keys.cordon(worker))]
        compares += [key_missing(self.keys.lease(worker, d)) for d in devices]
        puts: list[Op] = [Put(self.keys.lease(worker, d), holder.to_json(), lease=self.lease_id()) for d in devices]
        try:
            r = self._txn(compares, puts, [])
            applied, revision = r.succeeded, r.revision
        except WriteIndeterminate:
            applied, revision = self._ours(worker, devices, holder)
        if not applied:
            return None
        return Placement(holder.job, holder.slice, worker, info.incarnation, tuple(devices), revision)

    def _ours(self, worker: str, devices: list[int], holder: Holder) -> tuple[bool, int]:
        """After an indeterminate write: did our transaction apply?"""
        r = self.store.txn([], [Get(self.keys.lease(worker, d)) for d in devices])
        mine = all(read and (h := _holder(read[0])) is not None and h.nonce == holder.nonce for read in r.reads)
        return mine, r.revision

    def release(self, job: str, slice_name: str | None = None, *, worker: str | None = None) -> int:
        """Release every device held by ``job`` (or only by its ``slice_name``, only on ``worker``). Returns how many."""
        total = 0
        for _ in range(16):
            kvs, _rev = self.store.get_prefix(self.keys.worker_leases(worker) if worker else self.keys.leases)
            mine = [
                kv for kv in kvs
                if (h := _holder(kv)) is not None and h.job == job and (slice_name is None or h.slice == slice_name)
            ]
            if not mine:
                return total
            # In transactions of at most TXN_OPS deletes (etcd refuses more than 128 compares in one): a job
            # of many hosts holds more devices than that. A chunk that lost its race is read again.
            done = 0
            for i in range(0, len(mine), TXN_OPS):
                chunk = mine[i:i + TXN_OPS]
                r = self._txn([unchanged_since(kv.key, kv.mod_revision) for kv in chunk],
                              [Delete(kv.key) for kv in chunk], [])
                done += len(chunk) if r.succeeded else 0
            if done == len(mine):
                return total + done
            total += done
        raise AllocationError(f"could not release the devices of job {job!r}: they kept changing; retry")

    def cordon(self, worker: str, *, by: str = "operator") -> None:
        """Stop new leases on ``worker`` (its current leases stay)."""
        self._require_worker(worker)
        self.store.put(self.keys.cordon(worker), json.dumps({"by": by, "at": self.clock.wall()}))

    def uncordon(self, worker: str) -> bool:
        """Allow new leases on ``worker`` again. Returns whether it was cordoned."""
        self._require_worker(worker, allow_cordoned_only=True)
        return self.store.delete(self.keys.cordon(worker)) > 0

    def _require_worker(self, worker: str, *, allow_cordoned_only: bool = False) -> None:
        check_name("worker", worker)
        try:
            present = self.store.get(self.keys.worker(worker)) is not None
            if not present and allow_cordoned_only:
                present = self.store.get(self.keys.cordon(worker)) is not None
        except StoreError:
            raise
        if not present:
            raise UnknownWorker(
                f"no worker {worker!r} is registered in cluster {self.keys.cluster!r}; "
                "see `rallypoint workers` for the ids"
            )


def free_worker(store: Store, keys: Keys, fenced_txn: FencedTxn, worker: str, gone_at: int) -> int:
    """Delete ``worker``'s device leases made before revision ``gone_at`` (when its registration was seen deleted: an
    incarnation lost or leaving) and before its newer incarnation registered, if one did: those stay. Returns how
    many went."""
    now = store.get(keys.worker(worker))
    if now is not None:
        gone_at = min(gone_at, now.create_revision)
    kvs, _ = store.get_prefix(keys.worker_leases(worker))
    old = [kv for kv in kvs if kv.create_revision < gone_at]
    for i in range(0, len(old), TXN_OPS):
        chunk = old[i:i + TXN_OPS]
        fenced_txn([unchanged_since(kv.key, kv.mod_revision) for kv in chunk], [Delete(kv.key) for kv in chunk], [])
    return len(old)


def fence_worker(store: Store, keys: Keys, fenced_txn: FencedTxn, worker: str, incarnation: int) -> int | None:
    """Fence one incarnation of a worker: revoke its etcd lease, which deletes its
    registration and devices in one etcd operation (the leader then frees its device leases: :func:`free_worker`).

    Returns the revoked lease id, or None when that incarnation is already gone
    (its lease expired first, or it registered again). ``fenced_txn`` confirms the
    caller's term first: revoking a lease cannot carry a compare.
    """
    kv = store.get(keys.worker(worker))
    if kv is None or kv.create_revision != incarnation:
        return None
    fenced_txn([created_at(keys.worker(worker), incarnation)], [], [])
    store.revoke_lease(kv.lease)
    return kv.lease


def _holder(kv: KeyValue) -> Holder | None:
    """The holder record at ``kv``; None for a malformed one (logged and counted: rallypoint.etcd.records)."""
    return skip_bad(lambda: Holder.from_json(kv.value, kv.key))
