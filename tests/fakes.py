"""Fakes for unit tests of pure control logic: each subclasses the real interface it stands in for.

* :class:`MemoryStore` is a :class:`~rallypoint.etcd.store.Store` in memory: revisions,
  compare-and-swap transactions, leases that delete their keys when revoked. No
  watches (what uses them is tested against a real etcd).
* :class:`FakeElection` is a :class:`~rallypoint.orchestrator.control.election.LeaderElection`
  that holds a term by writing the leader key itself; the fenced writes are the real ones.
* :class:`FakeWorkers` is a :class:`~rallypoint.orchestrator.job.workers.JobWorkers`
  whose RPCs are answered in memory: granted steps complete at once (one ``done``
  event per instance, checkpoint commits every K steps), and tests script failures.

Integration tests never use these: they run real etcd and real worker processes.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc

from rallypoint.basics.clock import Clock
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.basics.errors import LeaseNotFound, NotLeader
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import Compare, Delete, Get, KeyValue, LeaseGrant, Op, Put, Store, TxnResult, Watch
from rallypoint.orchestrator.control.election import LeaderElection
from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.orchestrator.job.grants import StepGrant
from rallypoint.orchestrator.job.workers import JobWorkers
from rallypoint.proto import rallypoint_pb2 as pb


class MemoryStore(Store):
    def __init__(self) -> None:
        self.revision = 1
        self.kvs: dict[str, KeyValue] = {}
        self.leases: dict[int, int] = {}  # id -> ttl
        self._ids = itertools.count(0x1000)
        self._lock = threading.RLock()

    def get(self, key: str) -> KeyValue | None:
        with self._lock:
            return self.kvs.get(key)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        with self._lock:
            return sorted((kv for k, kv in self.kvs.items() if k.startswith(prefix)), key=lambda kv: kv.key), \
                self.revision

    def _put(self, key: str, value: bytes | str, lease: int) -> None:
        if lease and lease not in self.leases:
            raise LeaseNotFound(lease)
        old = self.kvs.get(key)
        raw = value if isinstance(value, bytes) else value.encode()
        self.kvs[key] = KeyValue(key, raw, old.create_revision if old else self.revision, self.revision,
                                 old.version + 1 if old else 1, lease)

    def _delete(self, key: str, prefix: bool) -> int:
        gone = [k for k in self.kvs if (k.startswith(key) if prefix else k == key)]
        for k in gone:
            del self.kvs[k]
        return len(gone)

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        with self._lock:
            self.revision += 1
            self._put(key, value, lease)
            return self.revision

    def delete(self, key: str, prefix: bool = False) -> int:
        with self._lock:
            self.revision += 1
            return self._delete(key, prefix)

    def _holds(self, c: Compare) -> bool:
        kv = self.kvs.get(c.key)
        field = {"version": "version", "create": "create_revision", "mod": "mod_revision", "value": "value",
                 "lease": "lease"}[c.target]
        have: Any = getattr(kv, field) if kv is not None else (b"" if c.target == "value" else 0)
        want = c.value.encode() if isinstance(c.value, str) else c.value
        return {"==": have == want, "!=": have != want, "<": have < want, ">": have > want}[c.op]

    def txn(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        with self._lock:
            ok = all(self._holds(c) for c in compares)
            ops = success if ok else failure
            if any(not isinstance(op, Get) for op in ops):
                self.revision += 1
            reads: list[list[KeyValue]] = []
            for op in ops:
                if isinstance(op, Put):
                    self._put(op.key, op.value, op.lease)
                elif isinstance(op, Delete):
                    self._delete(op.key, op.prefix)
                elif op.prefix:
                    reads.append(self.get_prefix(op.key)[0])
                else:
                    reads.append([self.kvs[op.key]] if op.key in self.kvs else [])
            return TxnResult(ok, self.revision, reads)

    def grant_lease(self, ttl_s: int) -> LeaseGrant:
        with self._lock:
            lease = next(self._ids)
            self.leases[lease] = ttl_s
            return LeaseGrant(lease, ttl_s)

    def keepalive(self, lease_id: int) -> int:
        with self._lock:
            if lease_id not in self.leases:
                raise LeaseNotFound(lease_id)
            return self.leases[lease_id]

    def revoke_lease(self, lease_id: int) -> None:
        with self._lock:
            self.leases.pop(lease_id, None)
            self.revision += 1
            for k in [k for k, kv in self.kvs.items() if kv.lease == lease_id]:
                del self.kvs[k]

    def lease_ttl(self, lease_id: int) -> int:
        with self._lock:
            return self.leases.get(lease_id, -1)

    def watch_prefix(self, prefix: str, start_revision: int) -> Watch:
        raise NotImplementedError("MemoryStore has no watches: test watch logic against a real etcd")

    def compact(self, revision: int) -> None:
        pass

    def close(self) -> None:
        pass


class FakeElection(LeaderElection):
    """Leads by writing the leader key; ``depose()`` hands the key to another term."""

    def __init__(self, store: MemoryStore, keys: Keys, clock: Clock) -> None:
        super().__init__(store, keys, "c1", clock=clock)
        self.store: MemoryStore = store
        self.lease = store.grant_lease(2).id
        store.put(keys.leader, '{"coordinator": "c1"}', lease=self.lease)
        kv = store.get(keys.leader)
        assert kv is not None
        self.term = kv.create_revision
        self.dead = False

    @property
    def is_leader(self) -> bool:
        return self.term is not None and not self.dead

    def check(self) -> None:
        if self.term is None or self.dead:
            raise NotLeader("coordinator c1", "not the leader")

    def depose(self) -> None:
        """Another coordinator takes the leader key (a new term); this one's lease is gone."""
        self.store.revoke_lease(self.lease)
        self.store.put(self.keys.leader, '{"coordinator": "c2"}')
        self.term, self.dead = None, True

    @property
    def keeper(self) -> Any:  # the fence the executor's TermWriter looks at
        return None if self.dead else _ALIVE

    @keeper.setter
    def keeper(self, value: Any) -> None:
        pass


class FakeLog:
    """A structlog logger's port: each event and its fields, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    warning = error = info


class FakeOutbox:
    """Stands in for the runtime's outbox: records what would be logged and pushed."""

    def __init__(self) -> None:
        self.sent: list[pb.TransferHeader] = []
        self.targets: set[tuple[str, int]] = set()

    def keep_only(self, targets: set[tuple[str, int]]) -> None:
        self.targets = targets

    def send(self, r: pb.Route, header: pb.TransferHeader, value: list[Any], *, log: bool = True) -> None:
        self.sent.append(header)


class _Alive:
    class fence:  # noqa: N801 - mirrors LeaseKeeper.fence
        dead = False


_ALIVE = _Alive()


def register_worker(store: MemoryStore, keys: Keys, worker: str, devices: int) -> int:
    """A worker as the daemon registers it: its key and device keys on its own lease. Returns the incarnation."""
    lease = store.grant_lease(2).id
    store.put(keys.worker(worker), f'{{"address": "{worker}:1", "data_address": "{worker}:2", "devices": {devices}}}',
              lease=lease)
    for d in range(devices):
        store.put(keys.device(worker, d), "{}", lease=lease)
    kv = store.get(keys.worker(worker))
    assert kv is not None
    return kv.create_revision


class FakeWorkers(JobWorkers):
    """The workers of one job, answered in memory (see the module doc).

    Scripting: ``load_failures`` (a list, one dict per ``load`` call, worker ->
    WorkerCallFailed), ``silent`` (workers that accept grants but never complete
    anything: hung), ``end(worker)`` (its event stream breaks: the process died).
    """

    def __init__(self, job: str, spec: pb.JobSpec, store: Store | None = None, keys: Keys | None = None) -> None:
        super().__init__(job)
        self.spec, self.store, self.keys = spec, store, keys
        self.load_failures: list[dict[str, WorkerCallFailed]] = []
        self.silent: set[str] = set()
        self.loads: list[tuple[str, int]] = []  # (worker, start step)
        self.rewires: list[tuple[str, int]] = []
        self.unloaded: list[str] = []
        self.cuts: list[tuple[str, int, int]] = []  # (worker, generation, the cut its grant told it), in order
        self.warms: list[tuple[str, list[str]]] = []  # (spare, the slices it was asked to warm)
        self._slices: dict[str, list[str]] = {}
        self._ran: dict[str, int] = {}  # worker -> next step it runs
        self._every = max(1, spec.checkpoint_every or 10)
        self._held_saves: set[tuple[str, int]] = set()

    def warm(self, worker: str, address: str, req: pb.WarmJobRequest,
             done: Callable[[str, pb.WarmJobResponse | None, str], None]) -> None:
        """A spare answers a warm request at once, having compiled nothing (no programs run here)."""
        self.warms.append((worker, [a.slice for a in req.slices]))
        done(worker, pb.WarmJobResponse(), "")

    def warm_now(self, worker: str, address: str, req: pb.WarmJobRequest, *, timeout_s: float) -> pb.WarmJobResponse:
        self.warms.append((worker, [a.slice for a in req.slices]))
        return pb.WarmJobResponse()

    def load(self, requests: Mapping[str, pb.LoadJobRequest], addresses: Mapping[str, str]) -> dict[str, WorkerCallFailed]:
        failed = self.load_failures.pop(0) if self.load_failures else {}
        for w, req in requests.items():
            if w in failed:
                continue
            gen = next(self._gens)
            self.identity[w], self.generation[w] = req.to, gen
            self._slices[w] = [sa.slice for sa in req.slices]
            self._ran[w] = int(req.start_step)
            self._every = max(1, int(req.checkpoint_every) or 10)
            self.loads.append((w, int(req.start_step)))
        return dict(failed)

    def grant(self, grants: Iterable[StepGrant]) -> None:
        for g in list(grants):
            w, cap, hold = g.worker, g.until, g.save_at or None
            if w in self.silent or w not in self.generation:
                continue
            self.cuts.append((w, self.generation[w], g.cut))
            gen = self.generation[w]
            while self._ran[w] < cap:
                s = self._ran[w]
                for n in self.spec.nodes:
                    if n.slice in self._slices[w] and s % max(n.every, 1) == 0:
                        for mb in range(self.spec.microbatches if n.per_microbatch else 1):
                            self.events.put(("done", (w, gen, pb.InstanceDone(node=n.name, step=s, microbatch=mb,
                                                                              compute_s=0.01))))
                self._ran[w] = s + 1
                if (s + 1) % self._every == 0 or (s + 1) == self.spec.steps:  # the schedule, and the final cut
                    for sl in self._slices[w]:
                        if self.store is not None and self.keys is not None:  # the worker commits, then reports
                            c = CheckpointCommit(self.job, sl, s + 1, f"/ck/{sl}/{s + 1}", "sum")
                            self.store.put(self.keys.checkpoint(self.job, sl, s + 1), json.dumps(c.to_json()))
                        self.events.put(("done", (w, gen, pb.InstanceDone(checkpoint_slice=sl,
                                                                          checkpoint_step=s + 1))))

            if hold is not None and self._ran[w] == hold and hold % self._every and (w, hold) not in self._held_saves:
                self._held_saves.add((w, hold))  # a drain holds the worker at its grant: it saves there
                for sl in self._slices[w]:
                    if self.store is not None and self.keys is not None:
                        c = CheckpointCommit(self.job, sl, hold, f"/ck/{sl}/{hold}", "sum")
                        self.store.put(self.keys.checkpoint(self.job, sl, hold), json.dumps(c.to_json()))
                    self.events.put(("done", (w, gen, pb.InstanceDone(checkpoint_slice=sl, checkpoint_step=hold))))

    def end(self, worker: str) -> None:
        """The worker's process died: its stream breaks and it runs nothing more."""
        self.silent.add(worker)
        self.events.put(("ended", (worker, self.generation[worker], "StatusCode.UNAVAILABLE Socket closed")))

    def rewire(self, worker: str, routes: Iterable[pb.Route], resend_to: Iterable[str], from_step: int,
               until: int, replica_targets: Iterable[pb.ReplicaPeer] = ()) -> pb.RewireResponse:
        self.rewires.append((worker, from_step))
        return pb.RewireResponse(resent=0, log_from=from_step)

    def rewire_all(self, requests: Mapping[str, pb.RewireRequest]
                   ) -> tuple[dict[str, pb.RewireResponse], dict[str, WorkerCallFailed]]:
        return {w: self.rewire(w, r.routes, r.resend_to, r.from_step, r.until_step, r.replica_targets)
                for w, r in requests.items()}, {}

    def unload(self, worker: str, *, flush_s: float = 0.0) -> None:
        self.unloaded.append(worker)

    def unload_stale(self, worker: str, address: str, to: pb.Identity) -> None:
        self.unloaded.append(worker)

    def fetch(self) -> list[pb.StateValue]:
        return []

    def fetch_all(self) -> tuple[list[pb.StateValue], dict[str, WorkerCallFailed]]:
        return [], {}

    def close(self) -> None:
        self.unloaded.extend(self.workers)


def call_failed(worker: str, code: grpc.StatusCode, details: str, metadata: Any = None) -> WorkerCallFailed:
    return WorkerCallFailed(worker, "LoadJob", code, details, metadata)
