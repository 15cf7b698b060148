"""A job's drains: taking up drain requests from etcd and carrying them out (``drain.py``).

:class:`JobDrains` owns the drains in flight (``drains``) and their records
(``drain_records``). The holds they need (a held worker is granted nothing at or past its
drain step) are decided by each :class:`Drain` and carried out by the job's grants'
owner (``hold``, the executor's; :mod:`~rallypoint.orchestrator.job.grants`). It is the
:class:`~rallypoint.orchestrator.job.drain.DrainPort` of its job, acting through the job's
collaborators: the placement (spare leases, the move), the loads (spares loaded,
survivors rewired) and the progress (what is done and committed; the moved slices' log
floor, returned). The executor polls the requests with its other etcd checks (:meth:`poll`)
and steps the drains in flight on every iteration of its loop (:meth:`step`), which returns
a :class:`DrainsStep`: the workers lost on the way (the executor recovers them, the drains
never do) and the output logs a move started past the cut (the executor's JobCut moves the
progress's log floor, the drains never do).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rallypoint.basics.clock import Clock
from rallypoint.basics.errors import StoreError
from rallypoint.etcd.cluster_view import ClusterSnapshot, read_cluster
from rallypoint.etcd.drains import DrainRequest, DrainResult, read_drain_requests
from rallypoint.etcd.records import Fields, key_parts, parsed, skip_bad
from rallypoint.etcd.store import Delete, Put
from rallypoint.orchestrator.control.devices import choose_gang
from rallypoint.orchestrator.job.drain import Drain, DrainPhase, DrainPort, DrainRecord
from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.orchestrator.job.grants import Hold
from rallypoint.orchestrator.job.loads import JobLoads
from rallypoint.orchestrator.job.placement import JobPlacement
from rallypoint.orchestrator.job.progress import JobProgress, LogFloor
from rallypoint.orchestrator.job.recovery import JobSettings
from rallypoint.orchestrator.job.requests import RequestReader, Requests
from rallypoint.orchestrator.job.state import FINAL_RECORD_STATES
from rallypoint.orchestrator.job.stop import StopRequest
from rallypoint.orchestrator.job.term import JobTerm
from rallypoint.recovery.load_plan import SlicePlace
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.remap import Remap, RemapPolicy, plan_remap
from rallypoint.recovery.replay import Graph
from rallypoint.recovery.slices import stateful_slices


@dataclass(frozen=True)
class DrainsStep:
    """What stepping the drains leaves for the executor to carry out."""

    lost: Mapping[str, str] = field(default_factory=dict)  # worker -> why: a worker call failed; recover it
    floors: tuple[LogFloor, ...] = ()  # the moves' output logs, which start past the cut (the progress's floor)


class JobDrains(DrainPort):
    """The drains of one job (see the module doc).

    Args:
        spec, graph: the job and its graph.
        term, placement, loads, progress: the job's collaborators the drains act through.
        clock, log: the injected clock and the executor's logger.
        event: sends a job event; ``grant(workers)`` grants workers the window (holds applied);
        hold: carries out a :class:`~rallypoint.orchestrator.job.grants.Hold` (and grants the held workers);
        running: whether the job runs undisturbed (no yield or grow starts otherwise);
        record: writes the job record (after a drain is done);
        suspend: asks the job to suspend (:class:`~rallypoint.orchestrator.job.stop.JobStop`'s ``request``):
            a higher-priority job asked for every slice it has.
        settings: the job's recovery settings (None: the spec's are not valid; the job fails before it runs).
    """

    def __init__(self, spec: pb.JobSpec, graph: Graph, *, term: JobTerm, placement: JobPlacement, loads: JobLoads,
                 progress: JobProgress, clock: Clock, log: Any, event: Callable[..., None],
                 grant: Callable[[list[str]], None], hold: Callable[[Hold], None], running: Callable[[], bool],
                 record: Callable[[], None], suspend: Callable[[StopRequest], bool] = lambda _r: False,
                 settings: JobSettings | None = None) -> None:
        self.spec, self.graph, self.term, self.places, self.loads, self.progress = \
            spec, graph, term, placement, loads, progress
        self.clock, self.log, self.event, self._grant, self._running, self._record = \
            clock, log, event, grant, running, record
        self._suspend, self._hold = suspend, hold
        self.settings = settings
        self.checkpoints = False  # whether the job keeps checkpoints (:meth:`open_run`)
        self.drains: dict[str, Drain] = {}  # worker -> the drain in flight
        self.drain_records: list[DrainRecord] = []
        self._ckpt_slices = stateful_slices(spec)
        self._answered: dict[str, int] = {}  # worker -> the request revision last answered
        self._floors: list[LogFloor] = []  # the floors the moves of this step made, for the executor
        self.reader = RequestReader(self._read, clock=clock, log=log)  # etcd read off the event path (job/requests.py)

    @property
    def placement(self) -> Mapping[str, SlicePlace]:  # type: ignore[override]
        return self.places.slices

    @property
    def parked_waiting(self) -> bool:
        """Some slices wait, off every device, for room (the job is not stalled for that)."""
        return any(d.parked for d in self.drains.values())

    def open_run(self, checkpoints: bool) -> None:
        """Whether the run keeps checkpoints (a run directory and a period): a drain of a stateful slice needs them."""
        self.checkpoints = checkpoints

    def to_json(self) -> list[dict[str, Any]]:
        return [d.to_json() for d in self.drain_records]

    # -- requests ---------------------------------------------------------------------

    def _read(self, with_cluster: bool, started: float) -> Requests:
        """What :meth:`poll` acts on, read from etcd (the reader's thread). Raises :class:`StoreError`."""
        store, keys = self.term.store, self.term.keys
        return Requests(read_drain_requests(store, keys), self._yields(),
                        read_cluster(store, keys) if with_cluster else None, started)

    def poll(self) -> None:
        """Start a drain for each new request that names a worker holding a slice of this job, from the newest
        reading of the requests (:class:`RequestReader`: none, when nothing new was read)."""
        got = self.reader.take()
        if got is None:
            return
        self.reader.with_cluster = not self.drains and any(  # a shrunk slice: the next readings look for room
            p.count < self.places.devices_of(s) for s, p in self.placement.items())
        requests = got.drains
        ours = ({p.worker for p in self.placement.values()} & set(self.loads.loaded)) | \
            {m.worker for p in self.placement.values() for m in p.members}  # a gang's members: it moves whole
        for worker, req in sorted(requests.items()):
            if worker not in ours or worker in self.drains or self._answered.get(worker) == req.revision:
                continue
            if self.progress.all_granted:
                continue  # every step is granted: the job ends soon and frees the worker anyway
            self.start(req)
        self._poll_yields(got.yields)
        self._poll_grow(got.cluster)

    def _yields(self) -> dict[str, dict[str, Any]]:
        """Slice -> the yield request a higher-priority job put for it. Raises :class:`StoreError`."""
        prefix = self.term.keys.job_yields(self.spec.job)
        kvs, _rev = self.term.store.get_prefix(prefix)
        out = {}
        for kv in kvs:
            got = skip_bad(lambda kv=kv: (key_parts(kv.key, prefix, 1, "yield")[0], Fields.of(kv, "yield").raw))
            if got is not None:
                out[got[0]] = got[1]
        return out

    def _poll_yields(self, asked: dict[str, dict[str, Any]]) -> None:
        """A higher-priority job asked for some of this job's slices: park them (save, release, wait for room).
        Asked for every slice, the job suspends instead, and the leader resumes it once room returns
        (orchestrator/service/verbs.py)."""
        if self.drains or not self._running() or self.progress.all_granted:
            return
        if asked and self.checkpoints and set(self.placement) <= set(asked):
            why = asked[min(asked)]
            req = StopRequest("suspend", checkpoint=True, by=f"job {why.get('for')} (priority {why.get('priority')})",
                              reason=f"a higher-priority job needs every device of job {self.spec.job!r}",
                              auto_resume=True, at=self.clock.wall())
            if self._suspend(req):  # kept in etcd too: a new leader adopting the job carries it out
                self.term.write_quietly("job.suspend_not_kept", [Put(self.term.keys.control(self.spec.job),
                                                                     json.dumps(req.to_json()))])
            return
        by_worker: dict[str, list[str]] = {}
        for s in sorted(asked):
            if s in self.placement and self.placement[s].worker in self.loads.workers:
                by_worker.setdefault(self.placement[s].worker, []).append(s)
        for worker, slices in sorted(by_worker.items()):
            why = asked[slices[0]]
            self.log.warning("drain.yield", slices=slices, to=why.get("for"), priority=why.get("priority"))
            self.start(DrainRequest(worker, "yield", f"job {why.get('for')}", self.clock.wall(), 0.0), only=slices,
                       park=True)
            return  # one at a time

    def _poll_grow(self, snap: ClusterSnapshot | None) -> None:
        """A slice running on fewer devices than declared (shrunk) moves back onto a worker with room for all of
        them, or a whole gang of workers when none holds them (docs/multihost.md), by a drain (nothing lost,
        nothing replayed), once there is room."""
        if self.drains or not self._running() or self.progress.all_granted or snap is None:
            return  # (no snapshot: none was asked for, no slice was shrunk; the next reading has it)
        for s, p in sorted(self.placement.items()):
            full = self.places.devices_of(s)
            if p.count >= full or any(o != s and q.worker == p.worker for o, q in self.placement.items()):
                continue
            away = frozenset(self.loads.loaded) | {m.worker for m in p.members}
            if full > max((w.info.devices for w in snap.workers.values()), default=0):  # back onto a whole gang
                fits = choose_gang(snap, full, exclude=away) is not None
            else:
                fits = isinstance(plan_remap(snap, {s: full}, RemapPolicy(on_no_spare="fail"), exclude=away), Remap)
            if fits:
                self.log.info("drain.grow", slice=s, devices=p.count, to=full)
                self.start(DrainRequest(p.worker, "grow", "executor", self.clock.wall(), 0.0), only=[s],
                           target={s: full})
                return

    def start(self, req: DrainRequest, **kw: Any) -> Drain:
        """Start a drain of ``req`` (``kw``: :class:`Drain`'s ``only``, ``target``, ``park``)."""
        d = Drain(self, len(self.drain_records) + 1, req, clock=self.clock, log=self.log, **kw)
        self.reader.invalidate()  # what was read before the drain started is not acted on again
        self.drain_records.append(d.record)
        self.drains[req.worker] = d
        self.log.info("drain.started", drain=d.record.number, worker=req.worker, reason=req.reason, by=req.by)
        self.event("job.draining", step=self.progress.completed, drain=d.record.number, worker=req.worker,
                   reason=req.reason)
        return d

    def step(self) -> DrainsStep:
        """Advance every drain in flight. Returns the workers lost on the way (worker -> why: a worker call that
        failed aborts its drain, and the executor recovers the worker) and the log floors the moves made."""
        for worker, d in list(self.drains.items()):
            try:
                phase = d.step()
            except WorkerCallFailed as exc:
                d.abort(str(exc))
                self.drains.pop(worker, None)
                return self._stepped({exc.worker: str(exc)})
            if phase.is_terminal:
                self.drains.pop(worker, None)
                self._answer(d)
        return self._stepped({})

    def _stepped(self, lost: dict[str, str]) -> DrainsStep:
        floors, self._floors = tuple(self._floors), []
        return DrainsStep(lost, floors)

    def abort(self, reason: str) -> list[str]:
        """A loss or the job's end: every drain in flight gives back what it took (the requests stay).

        Returns the slices that were parked (off every device): the recovery must place them.
        """
        parked = sorted(s for d in self.drains.values() for s in d.parked)
        for d in self.drains.values():
            d.abort(reason)
        self.drains.clear()
        return parked

    def preempted(self, lost: Mapping[str, str]) -> bool:
        """Whether every lost worker had asked for a preemption drain it did not finish (a preemption, not a fault)."""
        asked = {r.worker for r in self.drain_records if r.reason == "preempted" and r.state != "done"}
        return bool(lost) and set(lost) <= asked

    def busy(self) -> str:
        """Why the job is being moved by a drain now ("" when no drain runs)."""
        if not self.drains:
            return ""
        d = next(iter(self.drains.values()))
        return f"drain {d.record.number} of worker {d.worker} ({d.record.reason}) runs"

    def _answer(self, d: Drain) -> None:
        self.reader.invalidate()  # the readings from before its answer still show its request
        rec = d.record
        state = "done" if d.phase is DrainPhase.DONE else "cancelled"
        if d.request.revision:  # a request from etcd (a grow is the executor's own)
            self._answered[d.worker] = d.request.revision
            result = DrainResult(self.spec.job, state, d.request.revision, rec.detail, rec.to_json())
            self.term.write_quietly("drain.answer_failed",
                                    [Put(self.term.keys.drain_result(d.worker, self.spec.job), result.to_json())])
        if state == "done":
            self.log.info("drain.done", **rec.to_json())
            self.event("job.drained", **rec.to_json(), placement=self.places.to_json())  # the event's step: the drain's
            self._record()
        else:
            self.log.warning("drain.cancelled", worker=d.worker, reason=rec.detail)
            self.event("job.drain_cancelled", **(rec.to_json() | {"step": self.progress.completed}))

    def observe(self, worker: str, node: str, step: int) -> None:
        """An instance reported done (the drains in flight measure their pause with it)."""
        if self.drains:
            slice_name = self.graph.node(node).slice
            for d in self.drains.values():
                d.observe(worker, slice_name, step)

    # -- the DrainPort --------------------------------------------------------------------

    def loaded_workers(self) -> list[str]:
        return self.loads.loaded

    def drain_step(self) -> int:
        return self.progress.granted

    def why_not_drainable(self, slices: list[str]) -> str:
        stateful = sorted(set(slices) & set(self._ckpt_slices))
        if stateful and not self.checkpoints:
            return (f"slices {stateful} hold state and job {self.spec.job!r} keeps no checkpoints: a drain moves "
                    "state through one; give the coordinator a --checkpoint-dir (or the job a checkpoint_dir)")
        return ""

    def lease_spares(self, need: Mapping[str, int], exclude: frozenset[str], *,
                     shrink: bool = False) -> dict[str, SlicePlace] | str:
        return self.places.lease_spares(need, exclude, shrink=shrink)

    def release_spares(self, places: Mapping[str, SlicePlace]) -> None:
        self.places.release_spares(places)

    def park(self, worker: str, slices: list[str], step: int) -> None:
        self.loads.unload(worker)
        self._hold(Hold((worker,), None))
        self.places.release_on(worker, slices, "releasing a yielded slice's devices")
        self.log.info("drain.parked", slices=slices, step=step)
        self.event("job.yielded", step=step, slices=slices, worker=worker)

    def room_for(self, need: Mapping[str, int], slices: list[str]) -> dict[str, SlicePlace] | None:
        try:
            waiting = [w for s, w in self._yields().items()
                       if s in slices and not self._asker_ended(str(w.get("for", "")))]
        except StoreError:
            return None
        if waiting:
            return None  # the job that asked has not placed itself yet: do not take the devices back
        got = self.places.lease_spares(need, frozenset(self.loads.loaded), shrink=True)
        if isinstance(got, str):
            return None
        for s in slices:  # what the asking job left behind, if it ended without removing it
            self.term.until_etcd("removing a yield request", lambda s=s: self.term.txn(
                [Delete(self.term.keys.yield_slice(self.spec.job, s))]))
        return got

    def _asker_ended(self, job: str) -> bool:
        kv = self.term.store.get(self.term.keys.job(job)) if job else None
        record = parsed(kv, "job")  # a malformed record holds no devices hostage: its job counts as ended
        return record is None or record.get("state") in FINAL_RECORD_STATES

    def hold(self, worker: str, step: int | None) -> None:
        self._hold(Hold((worker,), step))

    def reached(self, slices: list[str], step: int) -> bool:
        nodes = [n.name for n in self.graph.nodes if n.slice in slices]
        return (all(self.progress.done_through(n) >= step for n in nodes)
                and all(self.progress.saved(s, step) for s in slices if s in self._ckpt_slices))

    def move(self, worker: str, places: Mapping[str, SlicePlace], step: int) -> None:
        others = {s: [m.worker for m in self.placement[s].members if m.worker != worker] for s in places}
        self.places.apply(places, drained_at=step)  # from here on the slices are the spares' (a failure is theirs)
        self.loads.unload(worker)  # what it pushed before it stopped arrives first; a gang's group ends with it
        self._hold(Hold((worker,), None))
        self.places.release_on(worker, places, "releasing the drained devices")
        for s, members in sorted(others.items()):  # a gang's other members (none of them is in the new gang)
            for m in members:
                self.places.release_on(m, [s], "releasing the drained gang's devices")
        commits = self.term.commits()
        new = {p.worker for p in places.values()} - set(self.loads.loaded)
        failures = self.loads.load(new, step, commits)
        if failures:
            raise next(iter(failures.values()))
        moved_nodes = sorted(n.name for n in self.graph.nodes if n.slice in places)
        survivors = [w for w in self.loads.loaded if w not in new and w in {p.worker for p in self.placement.values()}]
        answers, failed = self.loads.rewire_all(survivors, moved_nodes, step,
                                                {w: self.progress.grants.until(w) for w in survivors},
                                                commits)
        for w, r in answers.items():
            self.log.info("drain.rewired", worker=w, resent=r.resent, log_from=r.log_from)
        if failed:
            raise next(iter(failed.values()))
        self._floors.append(LogFloor(tuple(moved_nodes), step))  # the spares' output logs start at the drain step
        self._grant(sorted(new))
