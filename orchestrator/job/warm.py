"""Warm spares, the executor's side: carrying out the plan of ``recovery/warm.py`` with ``WarmJob``.

After the job is placed, after a recovery or a drain (which change who the spares
are), and whenever the spares change, :meth:`SpareWarmer.refresh` plans again which
spares warm which slices and tells only the spares whose part changed: the slices to
warm, on the devices a remap would lease them (the lowest free), with the slices'
exported programs; a spare that left the plan gets an empty request (it drops what it
held for the job). Nothing waits on the answers: each round of requests ends in one
``("warmed", ("", 0, detail))`` on the job's event queue, which the executor reports as
``job.warmed``. A failed warm is logged and reported, never fatal: the slice's programs
then compile at their first call after a loss, as without warming. At the job's end
:meth:`SpareWarmer.release` has every warmed spare drop what it holds for the job.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from rallypoint.basics.clock import SYSTEM_CLOCK, Clock
from rallypoint.basics.errors import StoreError
from rallypoint.etcd.cluster_records import ClusterSnapshot
from rallypoint.orchestrator.control.devices import choose_gang
from rallypoint.orchestrator.job.workers import RPC_TIMEOUT_S, JobWorkers
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.remap import eligible
from rallypoint.recovery.slices import slice_devices
from rallypoint.recovery.warm import plan_warm, warm_devices

Held = tuple[tuple[str, tuple[int, ...]], ...]  # (slice, local devices) a spare warms
WARM_CHECK_S = 5.0  # how often the warm-spare plan is made again (the spares may have changed)


@dataclass(frozen=True)
class SpareTarget:
    """What one spare is asked to hold for the job."""

    incarnation: int
    address: str
    held: Held
    members: int = 0  # gang member processes it keeps started for the job's multi-host slices


@dataclass
class _Round:
    number: int
    reason: str
    started: float
    plan: dict[str, list[str]]
    waiting: set[str]
    compile_s: dict[str, float] = field(default_factory=dict)  # spare -> seconds its compiles took
    failed: dict[str, str] = field(default_factory=dict)  # spare (or spare/node) -> why
    dropped: list[str] = field(default_factory=list)


class SpareWarmer:
    """The warm spares of one job (see the module doc)."""

    def __init__(self, spec: pb.JobSpec, workers: JobWorkers, *, cluster: str, term: int, max_spares: int,
                 log: Any, gangs: Callable[[], Mapping[str, list[str]]] = dict, clock: Clock = SYSTEM_CLOCK) -> None:
        if max_spares < 0:
            raise ValueError(f"warm_spares must be >= 0 (0: no warm spares), got {max_spares}")
        self.spec, self.workers, self.cluster, self.term, self.max_spares = spec, workers, cluster, term, max_spares
        self.log, self.clock = log, clock
        self.targets: dict[str, SpareTarget] = {}  # spare -> what it was last asked to hold
        self._rounds = itertools.count(1)
        self._lock = threading.Lock()
        self._open: set[int] = set()  # rounds with requests not yet answered
        self._due: str | None = None  # why the spares are to be warmed again, once the job moves past ...
        self._after = 0  # ... this many completed steps
        self._checked = float("-inf")
        self._need = slice_devices(spec)
        self._shapes = {s.slice: s for s in spec.slices}
        self._gangs = gangs  # the slices placed as gangs now -> their members' workers (docs/multihost.md)

    @property
    def plan(self) -> dict[str, list[str]]:
        """Spare -> the slices it was last asked to warm."""
        return {w: [s for s, _ in t.held] for w, t in sorted(self.targets.items()) if t.held}

    def soon(self, reason: str, completed: int) -> None:
        """Warm again once the job has completed a step past ``completed`` (its own compiles come first)."""
        self._due, self._after = reason, completed

    def due(self, now: float, completed: int, recovering: bool) -> str | None:
        """Why to plan again now (a :meth:`soon` whose step has passed, or ``WARM_CHECK_S`` since the last
        plan while no recovery runs: the spares may have changed); None: not now."""
        if self._due is not None:
            if completed <= self._after:
                return None
            reason, self._due = self._due, None
        elif recovering or now - self._checked < WARM_CHECK_S:
            return None
        else:
            reason = "the spares changed"
        self._checked = now
        return reason

    def check(self, now: float, completed: int, recovering: bool, snapshot: Callable[[], ClusterSnapshot], *,
              exclude: frozenset[str] = frozenset()) -> None:
        """Plan again from ``snapshot()`` when :meth:`due` says so (etcd away: not now, said in the log)."""
        reason = self.due(now, completed, recovering)
        if reason is None:
            return
        try:
            snap = snapshot()
        except StoreError as exc:
            self.log.warning("job.warm_unplanned", error=str(exc))
            return
        self.refresh(snap, reason, exclude=exclude)

    @property
    def warming(self) -> bool:
        """Some spare is still compiling for this job (a round of requests is not all answered)."""
        with self._lock:
            return bool(self._open)

    def refresh(self, snap: ClusterSnapshot, reason: str, *, exclude: frozenset[str] = frozenset()) -> bool:
        """Plan again from ``snap`` and send what changed; False when nothing did (no request sent)."""
        if self.max_spares <= 0 and not self.targets:
            return False
        spares = {w: snap.workers[w] for w in snap.spares if eligible(w, snap.workers[w], snap, exclude)}
        gangs = dict(self._gangs())
        plan = plan_warm({w: len(ws.free) for w, ws in spares.items()},
                         {s: n for s, n in self._need.items() if s not in gangs}, max_spares=self.max_spares)
        members = self._members(snap, spares, gangs, plan)
        want = {w: SpareTarget(snap.workers[w].info.incarnation, snap.workers[w].info.address,
                               tuple((s, warm_devices(spares[w].free, self._need[s])) for s in plan.get(w, ())),
                               members.get(w, 0))
                for w in sorted({*plan, *members})}
        changed = {w: t for w, t in want.items() if self.targets.get(w) != t}
        dropped = {w: t for w, t in self.targets.items() if w not in want and (t.held or t.members)}
        if not changed and not dropped:
            return False
        rnd = _Round(next(self._rounds), reason, self.clock.monotonic(),
                     {w: [s for s, _ in t.held] + ([f"gang members: {t.members}"] if t.members else [])
                      for w, t in want.items()},
                     waiting=set(changed) | set(dropped), dropped=sorted(dropped))
        self.targets = dict(want)
        with self._lock:
            self._open.add(rnd.number)
        self.log.info("job.warming", round=rnd.number, reason=reason, plan=rnd.plan, dropped=rnd.dropped)
        for w, t in sorted({**dropped, **changed}.items()):
            req = self.request(w, SpareTarget(t.incarnation, t.address, ()) if w in dropped else t)
            self.workers.warm(w, t.address, req, lambda w, resp, err, rnd=rnd: self._answered(rnd, w, resp, err))
        return True

    def _members(self, snap: ClusterSnapshot, spares: Mapping[str, Any], gangs: Mapping[str, list[str]],
                 plan: Mapping[str, list[str]]) -> dict[str, int]:
        """Worker -> gang member processes it keeps started for the job. No one spare compiles a multi-host slice's
        programs (they compile for the whole group), so the workers a new gang would be formed on keep a member
        started instead: the gang's own members' workers (a lost member's gang is formed again with the ones
        left) and the spares a new gang would take (``choose_gang`` among them), these within the budget of
        ``max_spares`` spares. A gang forms as fast as its slowest member starts: every one of them counts."""
        if self.max_spares <= 0:
            return {}
        out: dict[str, int] = {}
        others = frozenset(snap.workers) - set(spares)
        for s, workers in sorted(gangs.items()):
            for w in workers:
                if w in snap.workers:
                    out[w] = out.get(w, 0) + 1
            gang = choose_gang(snap, self._need[s], exclude=others)
            for w, _ in gang or ():
                if w in out or w in plan or len({*(set(out) & set(spares)), *plan}) < self.max_spares:
                    out[w] = out.get(w, 0) + 1
        return out

    def request(self, worker: str, target: SpareTarget) -> pb.WarmJobRequest:
        """The ``WarmJob`` request that asks ``worker`` to hold ``target`` (nothing held: drop the job)."""
        req = pb.WarmJobRequest(to=pb.Identity(cluster=self.cluster, worker_id=worker,
                                               incarnation=target.incarnation, term=self.term), job=self.spec.job,
                                members=target.members)
        slices = {s for s, _ in target.held}
        for s, devices in target.held:
            shape = self._shapes[s]
            req.slices.append(pb.SliceAssignment(slice=s, devices=devices, mesh_shape=shape.mesh_shape,
                                                 mesh_axes=shape.mesh_axes))
        for n in self.spec.nodes:
            if n.slice in slices:
                msg = pb.NodeProgram()
                msg.CopyFrom(n)
                msg.ClearField("variants")  # a spare warms the slice's full device count, what a remap gives it
                req.nodes.append(msg)
        return req

    def _answered(self, rnd: _Round, worker: str, resp: pb.WarmJobResponse | None, error: str) -> None:
        with self._lock:
            if resp is not None:
                rnd.compile_s[worker] = round(sum(resp.compile_s.values()), 4)
                rnd.failed.update({f"{worker}/{n}": why for n, why in resp.failed.items()})
            else:
                rnd.failed[worker] = error
                self.log.warning("job.warm_failed", worker=worker, round=rnd.number, error=error)
            rnd.waiting.discard(worker)
            if rnd.waiting:
                return
            self._open.discard(rnd.number)
        detail = {"round": rnd.number, "reason": rnd.reason, "plan": rnd.plan, "dropped": rnd.dropped,
                  "compile_s": rnd.compile_s, "failed": rnd.failed, "warm_s": round(self.clock.monotonic() - rnd.started, 3)}
        self.workers.events.put(("warmed", ("", 0, detail)))

    def release(self, registered: Mapping[str, int] | None = None) -> None:
        """The job ended: every warmed spare drops what it holds for it (best effort, in parallel, bounded).

        ``registered``: worker -> its incarnation now (a spare that re-registered holds nothing of ours).
        """
        held = {w: t for w, t in self.targets.items() if (t.held or t.members)
                and (registered is None or registered.get(w) == t.incarnation)}
        self.targets = {}
        if not held:
            return

        def drop(w: str, t: SpareTarget) -> None:
            try:
                self.workers.warm_now(w, t.address, self.request(w, SpareTarget(t.incarnation, t.address, ())),
                                      timeout_s=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                self.log.warning("job.unwarm_failed", worker=w, code=exc.code().name)

        with ThreadPoolExecutor(max_workers=len(held)) as pool:
            for w, t in held.items():
                pool.submit(drop, w, t)
