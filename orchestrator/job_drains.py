"""A job's drains: taking up drain requests from etcd and carrying them out (``drain.py``).

:class:`JobDrains` is the :class:`~rallypoint.orchestrator.drain.DrainPort` of a job: the
executor (``executor.py``) polls the requests with its other etcd checks
(:meth:`JobDrains.poll_drains`) and steps the drains in flight on every iteration of its
loop (:meth:`JobDrains.step_drains`). A worker held for a drain is granted nothing at or
past its drain step (:meth:`JobDrains.grant`).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping
from typing import Any

from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.etcd.drains import DrainRequest, DrainResult, read_drain_requests
from rallypoint.basics.errors import NotLeader, StoreError
from rallypoint.etcd.store import Delete, Put
from rallypoint.orchestrator.drain import Drain, DrainPhase, DrainPort, DrainRecord
from rallypoint.orchestrator.failures import WorkerCallFailed
from rallypoint.orchestrator.job_cluster import JobCluster
from rallypoint.orchestrator.job_state import FINAL_RECORD_STATES, JobState
from rallypoint.orchestrator.placement import SlicePlace
from rallypoint.recovery.remap import Remap, RemapPolicy, Shrink, plan_remap

FLUSH_S = 30.0  # how long a drained worker gets to deliver the pushes it had sent before it was unloaded
LEASE_ATTEMPTS = 4  # fresh plans after losing a race for spare devices


class JobDrains(JobCluster, DrainPort):
    """The drains of one job (see the module doc); the executor adds the rest of the lifecycle."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.drains: dict[str, Drain] = {}  # worker -> the drain in flight
        self.drain_records: list[DrainRecord] = []
        self.holds: dict[str, int] = {}  # worker -> its drain step
        self.log_floor: dict[str, int] = {}  # node -> the first step its output log holds, when past the cut
        self._saved: set[tuple[str, int]] = set()  # (slice, step) commits heard
        self._answered: dict[str, int] = {}  # worker -> the request revision last answered

    def record(self, **fields: Any) -> None:
        super().record(drains=[d.to_json() for d in self.drain_records], **fields)

    @abc.abstractmethod
    def _recover(self, lost: dict[str, str]) -> None:
        """Start a recovery of ``lost`` (the executor's)."""

    # -- requests ---------------------------------------------------------------------

    def poll_drains(self) -> None:
        """Start a drain for each new request that names a worker holding a slice of this job."""
        try:
            requests = read_drain_requests(self.store, self.keys)
        except StoreError:
            return  # etcd is away: requests wait
        ours = {p.worker for p in self.placement.values()} & set(self.loaded_workers())
        for worker, req in sorted(requests.items()):
            if worker not in ours or worker in self.drains or self._answered.get(worker) == req.revision:
                continue
            if self.granted >= self.spec.steps:
                continue  # every step is granted: the job ends soon and frees the worker anyway
            self.start_drain(req)
        self.poll_yields()
        self.poll_grow()

    def poll_yields(self) -> None:
        """A higher-priority job asked for some of this job's slices: park them (save, release, wait for room)."""
        if self.drains or self.state is not JobState.RUNNING or self.granted >= self.spec.steps:
            return
        try:
            kvs, _rev = self.store.get_prefix(self.keys.job_yields(self.spec.job))
        except StoreError:
            return
        asked = {self.keys.tail(kv.key, self.keys.job_yields(self.spec.job))[0]: kv.json() for kv in kvs}
        by_worker: dict[str, list[str]] = {}
        for s in sorted(asked):
            if s in self.placement and self.placement[s].worker in self.workers:
                by_worker.setdefault(self.placement[s].worker, []).append(s)
        for worker, slices in sorted(by_worker.items()):
            why = asked[slices[0]]
            self.log.warning("drain.yield", slices=slices, to=why.get("for"), priority=why.get("priority"))
            self.start_drain(DrainRequest(worker, "yield", f"job {why.get('for')}", time.time(), 0.0), only=slices,
                             park=True)
            return  # one at a time

    def poll_grow(self) -> None:
        """A slice running on fewer devices than declared (shrunk) moves back onto a worker with room for all of
        them, by a drain (nothing lost, nothing replayed), once one is there."""
        if self.drains or self.state is not JobState.RUNNING or self.granted >= self.spec.steps:
            return
        for s, p in sorted(self.placement.items()):
            full = self.devices_of(s)
            if len(p.devices) >= full or any(o != s and q.worker == p.worker for o, q in self.placement.items()):
                continue
            try:
                snap = read_cluster(self.store, self.keys)
            except StoreError:
                return
            fits = plan_remap(snap, {s: full}, RemapPolicy(on_no_spare="fail"),
                              exclude=frozenset(self.loaded_workers()))
            if isinstance(fits, Remap):
                self.log.info("drain.grow", slice=s, devices=len(p.devices), to=full)
                self.start_drain(DrainRequest(p.worker, "grow", "executor", time.time(), 0.0), only=[s],
                                 target={s: full})
                return

    def start_drain(self, req: DrainRequest, **kw: Any) -> Drain:
        d = Drain(self, len(self.drain_records) + 1, req, clock=self.clock, log=self.log, **kw)
        self.drain_records.append(d.record)
        self.drains[req.worker] = d
        self.log.info("drain.started", drain=d.record.number, worker=req.worker, reason=req.reason, by=req.by)
        self.event("job.draining", step=self.completed, drain=d.record.number, worker=req.worker, reason=req.reason)
        return d

    def step_drains(self) -> None:
        """Advance every drain in flight; a worker call that fails turns into the ordinary loss path."""
        if any(d.parked for d in self.drains.values()) and self.watchdog is not None:
            self.watchdog.progressed()  # a job waiting for its parked slices' room is not stalled
        for worker, d in list(self.drains.items()):
            try:
                phase = d.step()
            except WorkerCallFailed as exc:
                d.abort(str(exc))
                self.drains.pop(worker, None)
                self._recover({exc.worker: str(exc)})
                return
            if phase.is_terminal:
                self.drains.pop(worker, None)
                self._answer(d)

    def abort_drains(self, reason: str) -> list[str]:
        """A loss or the job's end: every drain in flight gives back what it took (the requests stay).

        Returns the slices that were parked (off every device): the recovery must place them.
        """
        parked = sorted(s for d in self.drains.values() for s in d.parked)
        for d in self.drains.values():
            d.abort(reason)
        self.drains.clear()
        return parked

    def _answer(self, d: Drain) -> None:
        rec = d.record
        state = "done" if d.phase is DrainPhase.DONE else "cancelled"
        if d.request.revision:  # a request from etcd (a grow is the executor's own)
            self._answered[d.worker] = d.request.revision
            result = DrainResult(self.spec.job, state, d.request.revision, rec.detail, rec.to_json())
            try:
                self.writer.txn([], [Put(self.keys.drain_result(d.worker, self.spec.job), result.to_json())])
            except (StoreError, NotLeader) as exc:
                self.log.warning("drain.answer_failed", worker=d.worker, error=str(exc))
        if state == "done":
            self.log.info("drain.done", **rec.to_json())
            self.event("job.drained", **rec.to_json(),  # the event's step: the drain step
                       placement={s: {"worker": p.worker, "incarnation": p.incarnation, "devices": list(p.devices)}
                                  for s, p in self.placement.items()})
            try:
                self.record()
            except (StoreError, NotLeader) as exc:
                self.log.warning("job.record_failed", error=str(exc))
        else:
            self.log.warning("drain.cancelled", worker=d.worker, reason=rec.detail)
            self.event("job.drain_cancelled", **(rec.to_json() | {"step": self.completed}))

    def on_instance(self, worker: str, node: str, step: int) -> None:
        """An instance reported done (the drains in flight measure their pause with it)."""
        if self.drains:
            slice_name = self.graph.node(node).slice
            for d in self.drains.values():
                d.observe(worker, slice_name, step)

    def on_saved(self, slice_name: str, step: int) -> None:
        """A checkpoint commit heard from a worker (a drain waits for its own)."""
        self._saved.add((slice_name, step))

    # -- granting -------------------------------------------------------------------------

    def grant(self, workers: list[str] | None = None) -> None:
        """Grant every worker (or ``workers``) the current window and cut; held workers up to their drain step."""
        self.workers.grant(self.granted, self.cut, workers, holds=self.holds)

    # -- the DrainPort --------------------------------------------------------------------

    def drain_step(self) -> int:
        return self.granted

    def why_not_drainable(self, slices: list[str]) -> str:
        stateful = sorted(set(slices) & set(self._ckpt_slices))
        if stateful and (self.run_dir is None or self.settings is None or self.settings.checkpoint_every <= 0):
            return (f"slices {stateful} hold state and job {self.spec.job!r} keeps no checkpoints: a drain moves "
                    "state through one; give the coordinator a --checkpoint-dir (or the job a checkpoint_dir)")
        return ""

    def lease_spares(self, need: Mapping[str, int], exclude: frozenset[str], *,
                     shrink: bool = False) -> dict[str, SlicePlace] | str:
        """``shrink``: fewer devices will do when the job allows it (on_no_spare='shrink')."""
        leases = self.leases()
        placed: dict[str, SlicePlace] = {}
        allow_shrink = shrink and self.settings is not None and self.settings.on_no_spare == "shrink"
        for _ in range(LEASE_ATTEMPTS):
            todo = {s: n for s, n in need.items() if s not in placed}
            if not todo:
                return placed
            snap = self.until_etcd("reading the cluster", lambda: read_cluster(self.store, self.keys))
            decision = plan_remap(snap, todo, RemapPolicy(on_no_spare="shrink" if allow_shrink else "fail"),
                                  exclude=exclude | {p.worker for p in placed.values()}, allowed=self.device_counts)
            if not isinstance(decision, Remap | Shrink):
                self.release_spares(placed)
                return getattr(decision, "reason", f"no spare devices ({type(decision).__name__})").replace(
                    "lost slice", "slice")
            for a in decision.assignments:
                self.lease_assignment(snap, a, leases, placed)
        self.release_spares(placed)
        return "other jobs kept taking the free devices first; ask again"

    def park(self, worker: str, slices: list[str], step: int) -> None:
        self.workers.unload(worker, flush_s=FLUSH_S)
        self.forget(worker)
        self.holds.pop(worker, None)
        self.release_on(worker, slices, "releasing a yielded slice's devices")
        self.log.info("drain.parked", slices=slices, step=step)
        self.event("job.yielded", step=step, slices=slices, worker=worker)

    def room_for(self, need: Mapping[str, int], slices: list[str]) -> dict[str, SlicePlace] | None:
        try:
            kvs, _rev = self.store.get_prefix(self.keys.job_yields(self.spec.job))
            pending = {self.keys.tail(kv.key, self.keys.job_yields(self.spec.job))[0]: kv.json() for kv in kvs}
            waiting = [w for s, w in pending.items() if s in slices and not self._asker_ended(str(w.get("for", "")))]
        except StoreError:
            return None
        if waiting:
            return None  # the job that asked has not placed itself yet: do not take the devices back
        got = self.lease_spares(need, frozenset(self.loaded_workers()), shrink=True)
        if isinstance(got, str):
            return None
        for s in slices:  # what the asking job left behind, if it ended without removing it
            self.until_etcd("removing a yield request", lambda s=s: self.writer.txn(
                [], [Delete(self.keys.yield_slice(self.spec.job, s))]))
        return got

    def _asker_ended(self, job: str) -> bool:
        kv = self.store.get(self.keys.job(job)) if job else None
        return kv is None or kv.json().get("state") in FINAL_RECORD_STATES

    def release_spares(self, places: Mapping[str, SlicePlace]) -> None:
        for s, p in places.items():
            self.release_on(p.worker, [s], "releasing spare devices")

    def hold(self, worker: str, step: int | None) -> None:
        if step is None:
            self.holds.pop(worker, None)
        else:
            self.holds[worker] = step
        if worker in self.workers:
            self.grant([worker])

    def reached(self, slices: list[str], step: int) -> bool:
        nodes = [n.name for n in self.graph.nodes if n.slice in slices]
        return (all(self.done_through(n) >= step for n in nodes)
                and all((s, step) in self._saved for s in slices if s in self._ckpt_slices))

    def move(self, worker: str, places: Mapping[str, SlicePlace], step: int) -> None:
        for s, p in places.items():
            had = len(self.placement[s].devices)
            if len(p.devices) != had:
                self.resharded.append({"slice": s, "from": had, "to": len(p.devices), "step": step, "at": time.time(),
                                       "why": "grew back (a worker with room joined)" if len(p.devices) > had
                                       else "drained onto fewer devices"})
        self.placement.update(places)  # from here on the slices are the spares' (a failure is their loss)
        self.workers.unload(worker, flush_s=FLUSH_S)  # what it pushed before it stopped arrives first
        self.forget(worker)
        self.holds.pop(worker, None)
        self.release_on(worker, places, "releasing the drained devices")
        commits = self.commits()
        new = {p.worker for p in places.values()} - set(self.loaded_workers())
        failures = self.load(new, step, commits)
        if failures:
            raise next(iter(failures.values()))
        moved_nodes = sorted(n.name for n in self.graph.nodes if n.slice in places)
        reqs = self.requests(None, step, commits)
        for w in self.loaded_workers():
            if w in new or w not in reqs:
                continue
            until = min(self.granted, self.holds.get(w, self.granted))
            r = self.workers.rewire(w, reqs[w].routes, moved_nodes, step, until)
            self.log.info("drain.rewired", worker=w, resent=r.resent, log_from=r.log_from)
        for n in moved_nodes:  # the spares' output logs start at the drain step
            self.log_floor[n] = step
        self.grant(sorted(new))
