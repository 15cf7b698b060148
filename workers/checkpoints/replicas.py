"""The in-memory checkpoint tier: copies of committed checkpoints in a peer's host memory.

After a slice's checkpoint commits (Orbax finalized it, etcd holds the commit with its
checksum), the saving worker's :class:`Replicator` pushes the same host arrays to the
slice's **holder** (``LoadJobRequest.replica_targets``, chosen by
:func:`rallypoint.recovery.replicas.plan_replicas`) over ``PushReplica``. The holder
keeps them in its :class:`ReplicaStore`, which lives at the worker-service level
(a holder may be a spare with no runtime of the job). A worker restoring a slice asks
the holder named in ``LoadJobRequest.replica_sources`` for the copy of the commit
(``FetchReplica``; its own store when it is the holder) and uses it only if
:func:`rallypoint.workers.checkpoints.checksums.checksum_of` what arrived equals the commit's
checksum; otherwise (holder unreachable, copy missing or evicted, checksum mismatch)
it reads the checkpoint from disk. :meth:`ReplicaTier.fetch` returns the tier used.

Zombies: a copy is pushed only after its commit succeeded, and the commit is guarded
on the saver's incarnation, so a zombie incarnation never pushes a copy of a commit it
could not make; a copy is trusted only through the commit's checksum, read from etcd
by the coordinator, never through the holder's word.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.basics.logs import get_logger
from rallypoint.basics.retry import retrying, transient_rpc
from rallypoint.proto import codec
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.checkpoints.checksums import checksum_of, commit_binding
from rallypoint.workers.checkpoints.restore import States
from rallypoint.workers.transfer import PeerChannels

PER_SLICE = 2
"""Copies kept per (job, slice): the newest received."""
LIMIT_BYTES = 2 << 30
"""Bytes a worker's store holds at most; past it the oldest copies (of any job) go."""
TTL_S = 1800.0
"""A job's copies not refreshed for this long are dropped (a finished job's, on a spare)."""
PUSH_RETRY_S = 10.0
FETCH_TIMEOUT_S = 30.0


@dataclass
class Replica:
    """One copy of a slice's committed checkpoint."""

    job: str
    slice_name: str
    step: int
    checksum: str  # the commit's, as the saver sent it
    states: States
    from_worker: str
    from_incarnation: int
    nbytes: int
    at: float = 0.0  # when stored (the store's clock)


def _nbytes(states: Mapping[str, Sequence[np.ndarray]]) -> int:
    return sum(int(np.asarray(x).nbytes) for leaves in states.values() for x in leaves)


class ReplicaStore:
    """Copies held for other workers: the newest ``per_slice`` per (job, slice), ``limit_bytes``
    in all (oldest evicted first), none older than ``ttl_s``. Thread-safe.

    ``corrupt``: a test fault (``--fault-corrupt-replicas``): every copy stored gets one
    byte flipped in memory, so restores from it fail their checksum.
    """

    def __init__(self, *, per_slice: int = PER_SLICE, limit_bytes: int = LIMIT_BYTES, ttl_s: float = TTL_S,
                 corrupt: bool = False, clock: Callable[[], float] = time.monotonic, log: Any = None) -> None:
        if per_slice < 1 or limit_bytes < 1:
            raise ValueError(f"a replica store keeps at least one copy and one byte, got per_slice={per_slice}, "
                             f"limit_bytes={limit_bytes}")
        self.per_slice, self.limit_bytes, self.ttl_s, self.corrupt = per_slice, limit_bytes, ttl_s, corrupt
        self._clock = clock
        self._lock = threading.Lock()
        self._copies: OrderedDict[tuple[str, str, int], Replica] = OrderedDict()  # oldest received first
        self.log = log or get_logger("rallypoint.replicas")

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._copies.values())

    def keys(self) -> list[tuple[str, str, int]]:
        with self._lock:
            return list(self._copies)

    def put(self, r: Replica) -> tuple[bool, str]:
        """Keep ``r`` (replacing a copy of the same step); returns (stored, why not)."""
        if r.nbytes > self.limit_bytes:
            return False, f"{r.nbytes} bytes exceed the replica store's limit of {self.limit_bytes}"
        if self.corrupt:
            r.states = _flip_one_byte(r.states)
        r.at = self._clock()
        evicted: list[tuple[tuple[str, str, int], str]] = []
        with self._lock:
            self._expire_locked()
            key = (r.job, r.slice_name, r.step)
            self._copies.pop(key, None)
            self._copies[key] = r
            same = [k for k in self._copies if k[:2] == key[:2]]
            for k in same[:-self.per_slice]:
                del self._copies[k]
                evicted.append((k, "per_slice"))
            total = sum(c.nbytes for c in self._copies.values())
            for k in list(self._copies):
                if total <= self.limit_bytes or k == key:
                    break
                total -= self._copies.pop(k).nbytes
                evicted.append((k, "limit_bytes"))
        for (job, s, step), why in evicted:
            self.log.info("replica.evicted", job=job, slice=s, step=step, reason=why)
        return True, ""

    def get(self, job: str, slice_name: str, step: int) -> Replica | None:
        with self._lock:
            self._expire_locked()
            return self._copies.get((job, slice_name, step))

    def drop_job(self, job: str) -> int:
        """Forget every copy of ``job``; returns how many went."""
        with self._lock:
            gone = [k for k in self._copies if k[0] == job]
            for k in gone:
                del self._copies[k]
        return len(gone)

    def _expire_locked(self) -> None:
        now = self._clock()
        newest: dict[str, float] = {}
        for r in self._copies.values():
            newest[r.job] = max(newest.get(r.job, r.at), r.at)
        for k in [k for k in self._copies if now - newest[k[0]] > self.ttl_s]:
            del self._copies[k]


def _flip_one_byte(states: States) -> States:
    """A copy of ``states`` with the first byte of its first non-empty leaf inverted (test fault)."""
    out = {name: [np.array(x, copy=True) for x in leaves] for name, leaves in states.items()}
    for name in sorted(out):
        for leaf in out[name]:
            if leaf.nbytes:
                flat = leaf.reshape(-1).view(np.uint8)
                flat[0] ^= 0xFF
                return out
    return out


class Replicator:
    """Pushes each committed checkpoint of a job's slices to their holders, on one thread.

    Only the newest commit of a slice waits to go: an older one still queued is dropped.
    A push is retried with the shared policy (:func:`~rallypoint.basics.retry.retrying`, on the
    channels' clock) on the transient codes every call between workers retries on, up to
    ``PUSH_RETRY_S`` or until the replicator closes.
    """

    def __init__(self, peers: PeerChannels, targets: Sequence[pb.ReplicaPeer], *, cluster: str, worker_id: str,
                 incarnation: int, log: Any) -> None:
        self._peers, self._cluster, self._worker, self._incarnation = peers, cluster, worker_id, incarnation
        self.log = log
        self._lock = threading.Lock()
        self._targets = {t.slice: t for t in targets}
        self._pending: dict[str, tuple[CheckpointCommit, States]] = {}
        self._wake: queue.Queue[None] = queue.Queue()
        self._closed = False
        self.pushed: list[tuple[str, int, str]] = []  # (slice, step, holder) of each copy stored
        self._thread = threading.Thread(target=self._loop, name="replicas", daemon=True)
        self._thread.start()

    def set_targets(self, targets: Sequence[pb.ReplicaPeer]) -> None:
        """New holders (the coordinator moved slices after a loss)."""
        with self._lock:
            self._targets = {t.slice: t for t in targets}

    def target(self, name: str) -> pb.ReplicaPeer | None:
        """The holder of slice (or multi-host slice's part) ``name`` now, if any."""
        with self._lock:
            return self._targets.get(name)

    def submit(self, commit: CheckpointCommit, states: States) -> None:
        """Copy a commit's states to the slice's holder (returns at once)."""
        with self._lock:
            if self._closed or commit.slice_name not in self._targets:
                return
            self._pending[commit.slice_name] = (commit, states)
        self._wake.put(None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._pending.clear()
        self._wake.put(None)

    def _loop(self) -> None:
        while True:
            self._wake.get()
            while True:
                with self._lock:
                    if self._closed:
                        return
                    if not self._pending:
                        break
                    slice_name = next(iter(self._pending))
                    commit, states = self._pending.pop(slice_name)
                    target = self._targets.get(slice_name)
                if target is not None:
                    self._push(target, commit, states)

    def _push(self, target: pb.ReplicaPeer, c: CheckpointCommit, states: States) -> None:
        header = pb.ReplicaHeader(
            to=pb.Identity(cluster=self._cluster, worker_id=target.worker_id, incarnation=target.incarnation),
            job=c.job, slice=c.slice_name, step=c.step, checksum=c.checksum, from_worker=self._worker,
            from_incarnation=self._incarnation)
        t0 = time.perf_counter()

        try:
            r = retrying(clock=self._peers.clock, what="replica push", retry_if=transient_rpc,
                         stop_after_s=PUSH_RETRY_S, should_stop=lambda: self._closed, initial_s=0.05, max_s=1.0,
                         jitter_s=0.05)(lambda: self._peers.stub(target.address, target.worker_id).PushReplica(
                             codec.replica_chunks(header, states), timeout=FETCH_TIMEOUT_S))
        except grpc.RpcError as exc:
            self.log.warning("replica.push_failed", slice=c.slice_name, step=c.step, holder=target.worker_id,
                             code=exc.code().name, error=exc.details())
            return
        if not r.stored:
            self.log.warning("replica.push_refused", slice=c.slice_name, step=c.step, holder=target.worker_id,
                             reason=r.reason)
            return
        self.pushed.append((c.slice_name, c.step, target.worker_id))
        self.log.info("replica.pushed", slice=c.slice_name, step=c.step, holder=target.worker_id,
                      bytes=_nbytes(states), push_s=round(time.perf_counter() - t0, 4))


class ReplicaTier:
    """A worker's side of the tier: the copies it holds for others, and fetching copies it restores from."""

    def __init__(self, worker_id: str, peers: PeerChannels, store: ReplicaStore) -> None:
        self.worker_id, self.peers, self.store = worker_id, peers, store

    def receive(self, header: pb.ReplicaHeader, states: States) -> tuple[bool, str]:
        """A copy pushed to this worker (``PushReplica``, after the gate)."""
        r = Replica(header.job, header.slice, int(header.step), header.checksum, states, header.from_worker,
                    int(header.from_incarnation), _nbytes(states))
        stored, why = self.store.put(r)
        self.store.log.info("replica.stored" if stored else "replica.refused", job=r.job, slice=r.slice_name,
                            step=r.step, bytes=r.nbytes, from_worker=r.from_worker,
                            from_incarnation=r.from_incarnation, reason=why or None)
        return stored, why

    def replicator(self, req: pb.LoadJobRequest, *, incarnation: int, log: Any) -> Replicator:
        return Replicator(self.peers, req.replica_targets, cluster=req.to.cluster, worker_id=self.worker_id,
                          incarnation=incarnation, log=log)

    def fetch(self, req: pb.LoadJobRequest, ref: pb.CheckpointRef, log: Any) -> States | None:
        """The copy of ``ref``'s commit from its holder, if one arrives whose checksum is the commit's.

        Never raises: every failure is logged (``replica.unavailable``, ``replica.corrupt``)
        and returns None, so the caller reads the disk.
        """
        source = next((p for p in req.replica_sources if p.slice == ref.slice), None)
        if source is None:
            return None
        where = dict(slice=ref.slice, step=int(ref.step), holder=source.worker_id)
        try:
            if source.worker_id == self.worker_id:
                r = self.store.get(req.job, ref.slice, int(ref.step))
                if r is None:
                    log.info("replica.unavailable", **where, reason="not held here")
                    return None
                checksum, states = r.checksum, r.states
            else:
                stream = self.peers.stub(source.address, source.worker_id).FetchReplica(pb.FetchReplicaRequest(
                    to=pb.Identity(cluster=req.to.cluster, worker_id=source.worker_id, incarnation=source.incarnation),
                    job=req.job, slice=ref.slice, step=int(ref.step)), timeout=FETCH_TIMEOUT_S)
                header, states = codec.assemble_replica(stream)
                checksum = header.checksum
        except grpc.RpcError as exc:
            log.info("replica.unavailable", **where, code=exc.code().name, reason=exc.details())
            return None
        except ValueError as exc:
            log.warning("replica.unavailable", **where, reason=f"malformed replica stream: {exc}")
            return None
        claimed = CheckpointCommit(req.job, ref.slice, int(ref.step), ref.path, ref.checksum)
        actual = checksum_of(states, ref.checksum, None, commit_binding(claimed))  # bound to the commit's identity
        if checksum != ref.checksum or actual != ref.checksum:
            log.warning("replica.corrupt", **where, expected=ref.checksum, sent=checksum, actual=actual)
            return None
        return states
