"""A job's placement: which worker's devices each virtual slice runs on, and the device leases behind it.

:class:`JobPlacement` is the one writer of the job's placement (slice ->
:class:`~rallypoint.recovery.load_plan.SlicePlace`) and of its record of device-count
changes (``resharded``); everyone else reads :attr:`JobPlacement.slices`, a read-only view.
It takes every device lease the job holds, in fenced etcd transactions of the job's term:

* :meth:`place`: every slice (the largest first) at the start; a slice that finds no free
  room asks lower-priority jobs to yield slices (the pure policy
  :func:`rallypoint.recovery.fairness.plan_preemption`), waits for them to be freed (up
  to the job's ``wait_timeout_s``) and leases them. The yield requests are withdrawn
  once the job is placed (:meth:`withdraw_yields`): the jobs that yielded may take
  devices back.
* :meth:`remap`: spare devices for a recovery's lost slices, per the job's
  ``on_no_spare`` (waits, shrinks or fails: :func:`rallypoint.recovery.remap.plan_remap`).
* :meth:`lease_spares`: spare devices for a drain, now or not at all.
* :meth:`apply`: the places a recovery or drain chose become the job's.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from rallypoint.basics.clock import Clock
from rallypoint.basics.errors import AllocationError, NoSpareDevices, NotLeader, StoreError
from rallypoint.etcd.cluster_view import ClusterSnapshot, job_records, read_cluster
from rallypoint.etcd.store import Delete, Put
from rallypoint.orchestrator.control.devices import DeviceLeases, Placement
from rallypoint.orchestrator.job.recovery import JobSettings, Reshard
from rallypoint.orchestrator.job.state import FINAL_RECORD_STATES
from rallypoint.orchestrator.job.term import JobTerm
from rallypoint.recovery.load_plan import SlicePlace, device_counts
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto.digest import RESHARD_TOLERANCE
from rallypoint.recovery.fairness import Holding, NoVictims, plan_preemption
from rallypoint.recovery.slices import slice_devices
from rallypoint.recovery.remap import Assignment, NoRoom, Remap, RemapPolicy, Shrink, Wait, eligible, plan_remap

REMAP_POLL_S = 0.25
LEASE_ATTEMPTS = 4  # fresh plans after losing a race for spare devices
PLACE_POLL_S = 0.1


class JobPlacement:
    """The placement of one job (see the module doc).

    Args:
        spec: the job.
        term: the job's etcd under its term.
        clock, log: the injected clock and the executor's logger.
        event: sends a job event (``event(name, step=..., **detail)``).
        settings: the job's recovery settings (None: the spec's are not valid, and the job fails before it places).
        leased: a test's hook, called (slice -> its workers, a gang's lead first) once :meth:`place` has leased
            every slice.
    """

    def __init__(self, spec: pb.JobSpec, term: JobTerm, *, clock: Clock, log: Any, event: Callable[..., None],
                 settings: JobSettings | None = None,
                 leased: Callable[[Mapping[str, tuple[str, ...]]], None] | None = None) -> None:
        self.spec, self.term, self.clock, self.log, self.event = spec, term, clock, log, event
        self.settings, self._leased = settings, leased  # leased: a test's hook (ExecutorHooks.leased)
        self._places: dict[str, SlicePlace] = {}
        self.resharded: list[Reshard] = []  # each change of a slice's device count (shrink, grow)
        self.nondeterministic: set[str] = set()  # workers it placed on that run nondeterministic kernels
        self.device_counts = device_counts(spec)  # slice -> the device counts its programs were exported for
        self._need = slice_devices(spec)
        self._asked: list[str] = []  # yield requests this job put (while it places itself)

    # -- the read-only view --------------------------------------------------------------------

    @property
    def slices(self) -> Mapping[str, SlicePlace]:
        """Slice -> where it runs now."""
        return MappingProxyType(self._places)

    def gangs(self) -> dict[str, list[str]]:
        """The slices placed as gangs now (multi-host slices) -> their members' workers, in process order."""
        return {s: [m.worker for m in p.members] for s, p in sorted(self._places.items()) if p.members}

    def devices_of(self, slice_name: str) -> int:
        """How many devices the slice declares."""
        return self._need[slice_name]

    def on(self, worker: str) -> list[str]:
        """The slices placed on ``worker``."""
        return sorted(s for s, p in self._places.items() if p.worker == worker)

    def gang_members(self) -> dict[str, int]:
        """Worker -> incarnation of every gang member that does not lead (the executor watches the leads)."""
        return {m.worker: m.incarnation for p in self._places.values() for m in p.members[1:]}

    def as_lead_losses(self, lost: Mapping[str, str]) -> tuple[dict[str, str], frozenset[str]]:
        """``lost`` with each gang member that does not lead joined by its gang's lead: the slice is lost as a
        unit, and the job's runtime on its lead, which drives it, with it (docs/multihost.md). Also the leads
        added so, which are alive: the recovery unloads the job there rather than fencing the worker."""
        out: dict[str, str] = {}
        for w, why in lost.items():
            lead = next(((s, p) for s, p in self._places.items() if any(m.worker == w for m in p.members[1:])), None)
            if lead is not None:
                out.setdefault(lead[1].worker, f"member {w} of multi-host slice {lead[0]!r} lost: {why}")
            out.setdefault(w, why)  # no slice of the job is on it: the recovery leaves it out of the new gang
        return out, frozenset(out) - set(lost)

    def group_lost(self, lead: str, member_worker: str, error: str) -> tuple[dict[str, str], frozenset[str]]:
        """The losses a lead's instance failure with ``group_lost`` amounts to: the lead (alive: it said so), and
        ``member_worker``, the worker of the member that was lost, when it is one of the lead's gang members
        (the lead's own worker or an unknown one adds nothing); and the lead, to unload rather than fence."""
        members = {m.worker for p in self._places.values() if p.worker == lead for m in p.members[1:]}
        named = [member_worker] if member_worker in members else []
        return ({lead: f"its multi-host slice lost a member: {error}",
                 **{w: "a member of a multi-host slice that was lost" for w in named}}, frozenset({lead}))

    def incarnations(self, worker: str) -> set[int]:
        return {p.incarnation for p in self._places.values() if p.worker == worker}

    def summary(self) -> dict[str, Any]:
        """The device-count changes, as ``job.finished`` reports them: a run with any is exact no more."""
        inexact = bool(self.resharded or self.nondeterministic)  # docs/platforms.md
        return {"resharded": [r.to_json() for r in self.resharded], "exact": not inexact,
                **({"nondeterministic_workers": sorted(self.nondeterministic)} if self.nondeterministic else {}),
                **({"tolerance": RESHARD_TOLERANCE} if inexact else {})}

    def to_json(self) -> dict[str, Any]:
        return {s: {"worker": p.worker, "incarnation": p.incarnation, "devices": list(p.devices),
                    **({"members": [{"worker": m.worker, "incarnation": m.incarnation, "devices": list(m.devices)}
                                    for m in p.members]} if p.members else {})}
                for s, p in self._places.items()}

    # -- placing the job ---------------------------------------------------------------------------

    def place(self, snapshot: Callable[[], ClusterSnapshot], *, adopting: bool = False,
              resuming: bool = False) -> dict[str, str] | NoRoom:
        """Lease devices for every slice (the largest first), taking room from lower-priority jobs if need be;
        :class:`NoRoom` (the executor fails the job with its reason) when a slice cannot be placed after all.
        Else the workers it chose that were lost meanwhile (worker -> why; a gang member's too): their slices
        stay placed on them, the executor loads the others and recovers these like any loss (docs/recovery.md).

        ``adopting``: a new leader places a job that was running (its workers may have been lost with the old
        leader); a slice that finds no room then waits, shrinks or fails as the job's ``on_no_spare`` says, like
        a recovery's remap (:meth:`_no_room_adopting`). ``resuming`` (a suspended, cancelled or failed run goes
        on): as adopting, but a slice declared ``devices=(min, max)`` first takes the most devices free for it
        within its counts, whatever ``on_no_spare`` says: a resume runs on whatever is free (within the reshard
        tolerance when a count changed). A new job that finds no room fails at once (raises :class:`NoSpareDevices`).
        """
        leases, before = self.term.leases(), snapshot()
        gangs: dict[str, tuple[Placement, ...]] = {}
        largest = max((w.info.devices for w in before.workers.values()), default=0)
        for s in sorted(self.spec.slices, key=lambda s: -self.devices_of(s.slice)):
            if min(self.device_counts.get(s.slice) or [self.devices_of(s.slice)]) > largest > 0:
                # no worker holds it at any of its device counts: a multi-host slice (docs/multihost.md)
                gangs[s.slice] = leases.allocate_gang(self.spec.job, s.slice, self.devices_of(s.slice))
                p = gangs[s.slice][0]
                self._places[s.slice] = SlicePlace(p.worker, "", p.incarnation, p.devices)
                continue
            try:
                p = leases.allocate(self.spec.job, s.slice, self.devices_of(s.slice))
            except NoSpareDevices:
                try:
                    p = self._take_from_lower_priority(s.slice)
                except NoSpareDevices as exc:
                    if not (adopting or resuming):
                        raise
                    p = (self._shrunk(s.slice, "resumed with no worker with all its devices free") if resuming
                         else None) or self._no_room_adopting(s.slice, exc)
            if isinstance(p, NoRoom):
                return p
            self._places[s.slice] = SlicePlace(p.worker, "", p.incarnation, p.devices)
        if self._leased is not None:
            self._leased({s: tuple(q.worker for q in gangs.get(s, ())) or (p.worker,) for s, p in self._places.items()})
        snap, lost = snapshot(), dict[str, str]()

        def found(p: Any, name: str) -> SlicePlace:
            w = snap.workers.get(p.worker)
            if w is None or w.info.incarnation != p.incarnation:  # a loss for the recovery, not the job's end
                lost.setdefault(p.worker, f"lost while the job was being placed (it held slice {name!r})")
                w = before.workers.get(p.worker)  # the address it had, for the routes until the recovery
                return SlicePlace(p.worker, w.info.address if w else "", p.incarnation, p.devices)
            if not w.info.deterministic:
                self.nondeterministic.add(p.worker)
            return SlicePlace(p.worker, w.info.address, p.incarnation, p.devices, w.info.data_address)

        for name, p in self._places.items():
            members, lead = tuple(found(m, name) for m in gangs.get(name, ())), found(p, name)
            self._places[name] = SlicePlace(lead.worker, lead.address, lead.incarnation, lead.devices,
                                            lead.data_address, members)
        if lost:
            self.log.warning("job.lost_while_placing", lost=lost)
        self.event("job.placed", **self.to_json())
        return lost

    def _shrunk(self, slice_name: str, why: str, counts: Sequence[int] | None = None) -> Placement | None:
        """The slice leased on the most devices free for it below its full count, among ``counts`` (default: the
        counts its programs were exported for); recorded in ``resharded``. None: no worker has room for any."""
        need = self.devices_of(slice_name)
        for count in sorted((c for c in (counts or self.device_counts.get(slice_name) or ()) if c < need),
                            reverse=True):
            try:
                p = self.term.leases().allocate(self.spec.job, slice_name, count)
            except NoSpareDevices:
                continue
            self.resharded.append(Reshard(slice_name, need, count, why, at=self.clock.wall()))
            self.log.warning("job.shrunk", slice=slice_name, devices=count, had=need)
            return p
        return None

    def _no_room_adopting(self, slice_name: str, none: NoSpareDevices) -> Placement | NoRoom:
        """Adopting, ``slice_name`` finds no room: wait for a worker (up to ``wait_timeout_s``), shrink or
        :class:`NoRoom`."""
        assert self.settings is not None
        leases, need, on = self.term.leases(), self.devices_of(slice_name), self.settings.on_no_spare
        if on == "shrink":
            counts = self.device_counts.get(slice_name) or [d for d in range(1, need + 1) if need % d == 0]
            p = self._shrunk(slice_name, f"adopted with no worker with {need} free devices (on_no_spare='shrink')",
                             counts)
            if p is not None:
                return p
            return NoRoom(reason=f"{none}; on_no_spare='shrink' found no worker with room for any of its device "
                               f"counts {sorted(counts)} either")
        if on == "fail":
            return NoRoom(reason=f"{none} (on_no_spare='fail')")
        timeout = self.settings.wait_timeout_s
        self.log.warning("job.waiting", missing={slice_name: need}, timeout_s=timeout, adopted=True)
        self.event("job.waiting", missing={slice_name: need}, timeout_s=timeout,
                   reason=f"no spare for ['{slice_name}'] on adoption: waiting up to {timeout:g}s for a worker "
                          "with room to join")
        t0 = self.clock.monotonic()
        while True:
            self.term.hold()
            waited = self.clock.monotonic() - t0
            if waited >= timeout:
                return NoRoom(reason=f"{none}; waited {waited:.0f} s of wait_timeout_s={timeout:g}: add a worker "
                                   f"with {need} free devices, or raise wait_timeout_s")
            self.clock.sleep(REMAP_POLL_S)
            try:
                return leases.allocate(self.spec.job, slice_name, need)
            except NoSpareDevices:
                continue

    def _take_from_lower_priority(self, slice_name: str) -> Placement | NoRoom:
        """No free room for the slice: ask lower-priority jobs to yield slices (``recovery.fairness``), then lease;
        :class:`NoRoom` when what they were asked to yield is not freed within ``wait_timeout_s``.

        Raises the original :class:`NoSpareDevices` when no lower-priority slice makes room.
        """
        assert self.settings is not None
        need, store, keys = self.devices_of(slice_name), self.term.store, self.term.keys
        snap = read_cluster(store, keys)
        priorities = {j: int(r.get("priority", 0)) for j, r in job_records(store, keys).items()
                      if r.get("state") not in FINAL_RECORD_STATES}
        holdings = [Holding(job, sl, w, n, priorities[job])
                    for w, ws in snap.workers.items()
                    for (job, sl), n in Counter((h.job, h.slice) for h in ws.holders.values()).items()
                    if job != self.spec.job and job in priorities]
        free = {w: len(ws.free) for w, ws in snap.workers.items() if eligible(w, ws, snap)}
        plan = plan_preemption({slice_name: need}, priority=self.spec.priority, free=free, holdings=holdings)
        if isinstance(plan, NoVictims):
            raise NoSpareDevices(self.spec.job, slice_name, need, max(free.values(), default=0))
        asked = [keys.yield_slice(v.job, v.slice) for v in plan.victims]
        why = json.dumps({"for": self.spec.job, "priority": self.spec.priority, "slice": slice_name,
                          "at": self.clock.wall()})
        self.term.txn([Put(k, why) for k in asked])
        victims = [f"{v.job}/{v.slice} (priority {v.priority}, on {v.worker})" for v in plan.victims]
        self.log.warning("job.preempting", slice=slice_name, victims=victims)
        self.event("job.waiting", reason=f"no free room for slice {slice_name!r} ({need} devices): taking "
                   f"{', '.join(victims)} from lower-priority jobs", missing={slice_name: need}, victims=victims)
        self._asked += asked
        leases = self.term.leases()
        t0 = self.clock.monotonic()
        while True:
            self.term.hold()
            try:
                return leases.allocate(self.spec.job, slice_name, need)
            except NoSpareDevices:
                if self.clock.monotonic() - t0 > self.settings.wait_timeout_s:
                    return NoRoom(reason=f"slice {slice_name!r}: the lower-priority slices asked to yield "
                                       f"({', '.join(victims)}) did not free {need} devices within wait_timeout_s="
                                       f"{self.settings.wait_timeout_s:g}")
                self.clock.sleep(PLACE_POLL_S)

    def withdraw_yields(self) -> None:
        """Placed (or ended): the lower-priority jobs may take devices back."""
        if self._asked and self.term.write_quietly("job.withdraw_failed", [Delete(k) for k in self._asked]):
            self._asked = []

    # -- moving slices ------------------------------------------------------------------------------

    def apply(self, places: Mapping[str, SlicePlace], *, drained_at: int | None = None) -> None:
        """The slices of ``places`` run there from now on (a recovery's remap, a drain's move).

        ``drained_at``: a drain moved them at that step; a slice whose device count changes
        on the way (grown back, or drained onto fewer devices) is recorded in ``resharded``.
        """
        for s, p in places.items():
            had = self._places.get(s)
            if drained_at is not None and had is not None and p.count != had.count:
                grew = p.count > had.count
                self.resharded.append(Reshard(s, had.count, p.count, "grew back (a worker with room joined)" if grew
                                              else "drained onto fewer devices", at=self.clock.wall(), step=drained_at))
        self._places.update(places)

    def remap(self, need: Mapping[str, int], exclude: frozenset[str], recovery: int, *,
              lost: Mapping[str, int] = MappingProxyType({})) -> tuple[dict[str, SlicePlace], float] | NoRoom:
        """Lease spare devices for each lost slice of recovery number ``recovery`` per the job's policy (waits,
        or decides :class:`NoRoom`: no spare within the policy; the recovery fails, and the job with it).

        ``exclude``: workers not used whatever their incarnation; ``lost``: worker -> the incarnation
        a recovery lost (a newer one of the same worker is a spare like any other).

        Returns the places leased (:meth:`apply` makes them the job's) and the seconds it waited for a
        worker with room (the recovery records them: the goodput bucket waiting_for_spares).
        """
        assert self.settings is not None
        policy = RemapPolicy(on_no_spare=self.settings.on_no_spare, wait_timeout_s=self.settings.wait_timeout_s)
        leases = self.term.leases()
        store, keys = self.term.store, self.term.keys
        snap = self.term.until_etcd("reading the cluster", lambda: read_cluster(store, keys))
        largest = max((w.info.devices for w in snap.workers.values()), default=0)
        # a gang, or a slice no worker holds at any of its device counts: a whole new gang (or a smaller one)
        placed: dict[str, SlicePlace] = {}
        for s, n in need.items():
            if min(self.device_counts.get(s) or [n]) > largest or (self._places.get(s) is not None
                                                                   and self._places[s].members):
                gang = self._regang(s, n, exclude)
                if isinstance(gang, NoRoom):
                    return gang
                placed[s] = gang
        t0, told, waited_from = self.clock.monotonic(), False, 0.0
        while True:
            self.term.hold()
            todo = {s: n for s, n in need.items() if s not in placed}
            if not todo:
                return placed, (self.clock.monotonic() - waited_from if told else 0.0)
            snap = self.term.until_etcd("reading the cluster", lambda: read_cluster(store, keys))
            decision = plan_remap(snap, todo, policy, exclude=exclude, waited_s=self.clock.monotonic() - t0,
                                  allowed=self.device_counts, lost_incarnations=lost)
            if isinstance(decision, Remap | Shrink):
                for a in decision.assignments:
                    if self._lease(snap, a, leases, placed) and a.shrunk:
                        self.resharded.append(Reshard(a.slice, a.needed, len(a.devices),
                                                      f"recovery {recovery}: no spare with {a.needed} "
                                                      "devices (on_no_spare='shrink')", at=self.clock.wall()))
                        self.log.warning("recovery.shrunk", slice=a.slice, devices=len(a.devices), had=a.needed)
                continue
            if isinstance(decision, Wait):
                if not told:
                    told, waited_from = True, self.clock.monotonic()
                    self.log.warning("recovery.waiting", missing=dict(decision.missing), timeout_s=decision.timeout_s)
                    self.event("job.waiting", recovery=recovery, missing=dict(decision.missing),
                               timeout_s=decision.timeout_s,
                               reason=f"no spare for {sorted(decision.missing)}: waiting up to {decision.timeout_s:g}s "
                                      "for a worker with room to join")
                self.clock.sleep(REMAP_POLL_S)
                continue
            if isinstance(decision, NoRoom):
                return decision
            return NoRoom(reason=f"remap decided {type(decision).__name__}, which this executor does not carry out")

    def _regang(self, slice_name: str, count: int, exclude: frozenset[str]) -> SlicePlace | NoRoom:
        """A lost multi-host slice's new gang: what its surviving members hold is let go, then a whole gang is
        leased (one transaction), waiting for room up to ``wait_timeout_s`` (then :class:`NoRoom`)."""
        assert self.settings is not None
        leases, t0 = self.term.leases(), self.clock.monotonic()
        self.term.until_etcd("releasing the lost gang", lambda: leases.release(self.spec.job, slice_name))
        while True:
            self.term.hold()
            try:
                gang = leases.allocate_gang(self.spec.job, slice_name, count, exclude=exclude)
            except NoSpareDevices as exc:
                shrunk = self._shrunk_gang(slice_name, count, exclude) if self.settings.on_no_spare == "shrink" \
                    else None
                if shrunk is not None:
                    return shrunk
                if self.clock.monotonic() - t0 >= self.settings.wait_timeout_s or self.settings.on_no_spare == "fail":
                    return NoRoom(reason=f"multi-host slice {slice_name!r}: {exc}")
                self.clock.sleep(REMAP_POLL_S)
                continue
            try:
                return self._gang_place(slice_name, gang)
            except AllocationError:
                leases.release(self.spec.job, slice_name)  # a member left between the lease and the read: again

    def _shrunk_gang(self, slice_name: str, count: int, exclude: frozenset[str]) -> SlicePlace | None:
        """A lost gang with no room for a whole new one, on fewer devices (``on_no_spare='shrink'``): the largest
        of the slice's other device counts that room is free for now, as a smaller gang (fewer hosts) or on one
        worker; None when there is room for none. A change of device count is recorded (``resharded``)."""
        leases, store, keys = self.term.leases(), self.term.store, self.term.keys
        snap = self.term.until_etcd("reading the cluster", lambda: read_cluster(store, keys))
        largest = max((w.info.devices for w in snap.workers.values()), default=0)
        for c in sorted((c for c in self.device_counts.get(slice_name, ()) if c < count), reverse=True):
            if c > largest:
                try:
                    place = self._gang_place(slice_name, leases.allocate_gang(self.spec.job, slice_name, c,
                                                                              exclude=exclude))
                except AllocationError:
                    leases.release(self.spec.job, slice_name)  # none had room, or a member left meanwhile
                    continue
            else:
                decision = plan_remap(snap, {slice_name: c}, RemapPolicy(on_no_spare="fail"), exclude=exclude,
                                      allowed=self.device_counts)
                placed: dict[str, SlicePlace] = {}
                if not isinstance(decision, Remap) or not self._lease(snap, decision.assignments[0], leases, placed):
                    continue
                place = placed[slice_name]
            self.resharded.append(Reshard(slice_name, count, c,
                                          f"no room for a whole gang of {count} devices (on_no_spare='shrink')",
                                          at=self.clock.wall()))
            self.log.warning("recovery.shrunk", slice=slice_name, devices=c, had=count, members=len(place.members))
            return place
        return None

    def _gang_place(self, slice_name: str, gang: Sequence[Placement]) -> SlicePlace:
        """The place of a gang just leased (its lead first); AllocationError when a member left meanwhile."""
        snap = self.term.until_etcd("reading the cluster", lambda: read_cluster(self.term.store, self.term.keys))
        members = tuple(SlicePlace(p.worker, snap.workers[p.worker].info.address, p.incarnation, p.devices,
                                   snap.workers[p.worker].info.data_address)
                        for p in gang if p.worker in snap.workers)
        if len(members) != len(gang):
            raise AllocationError(f"a member of the new gang of slice {slice_name!r} left while it was leased")
        lead = members[0]
        return SlicePlace(lead.worker, lead.address, lead.incarnation, lead.devices, lead.data_address, members)

    def lease_spares(self, need: Mapping[str, int], exclude: frozenset[str], *,
                     shrink: bool = False) -> dict[str, SlicePlace] | str:
        """Lease devices for each slice of ``need`` now (no waiting), or say why there are none.

        ``shrink``: fewer devices will do when the job allows it (on_no_spare='shrink').
        """
        leases = self.term.leases()
        placed: dict[str, SlicePlace] = {}
        allow_shrink = shrink and self.settings is not None and self.settings.on_no_spare == "shrink"
        store, keys = self.term.store, self.term.keys
        snap = self.term.until_etcd("reading the cluster", lambda: read_cluster(store, keys))
        largest = max((w.info.devices for w in snap.workers.values()), default=0)
        for s in sorted(s for s in need if need[s] > largest):
            gang: Sequence[Placement] = ()
            try:  # a multi-host slice: a whole new gang, in one transaction (docs/multihost.md)
                gang = leases.allocate_gang(self.spec.job, s, need[s], exclude=exclude | {p.worker for p in placed.values()})
                placed[s] = self._gang_place(s, gang)
            except AllocationError as exc:  # none (NoSpareDevices), or a member left before it was placed
                for p in gang:
                    self.release_on(p.worker, [s], "releasing a gang a member left")
                self.release_spares(placed)
                return f"multi-host slice {s!r}: {exc}"
        for _ in range(LEASE_ATTEMPTS):
            todo = {s: n for s, n in need.items() if s not in placed}
            if not todo:
                return placed
            snap = self.term.until_etcd("reading the cluster", lambda: read_cluster(store, keys))
            decision = plan_remap(snap, todo, RemapPolicy(on_no_spare="shrink" if allow_shrink else "fail"),
                                  exclude=exclude | {p.worker for p in placed.values()}, allowed=self.device_counts)
            if not isinstance(decision, Remap | Shrink):
                self.release_spares(placed)
                return getattr(decision, "reason", f"no spare devices ({type(decision).__name__})").replace(
                    "lost slice", "slice")
            for a in decision.assignments:
                self._lease(snap, a, leases, placed)
        self.release_spares(placed)
        return "other jobs kept taking the free devices first; ask again"

    def _lease(self, snap: ClusterSnapshot, a: Assignment, leases: DeviceLeases, placed: dict[str, SlicePlace]) -> bool:
        """Lease the devices the remap policy chose for one slice into ``placed``; False: another holder won them."""
        p = self.term.until_etcd("leasing spare devices",
                                 lambda: leases.lease(self.spec.job, a.slice, a.worker, a.devices))
        if p is None:
            return False
        info = snap.workers[a.worker].info
        placed[a.slice] = SlicePlace(a.worker, info.address, p.incarnation, p.devices, info.data_address)
        if not info.deterministic:
            self.nondeterministic.add(a.worker)
        return True

    # -- releasing -------------------------------------------------------------------------------------

    def release_on(self, worker: str, slices: Iterable[str], what: str) -> None:
        """Release the devices the job's ``slices`` hold on ``worker`` (etcd outages ridden out)."""
        leases = self.term.leases()
        for s in slices:
            self.term.until_etcd(what, lambda s=s: leases.release(self.spec.job, s, worker=worker))

    def release_spares(self, places: Mapping[str, SlicePlace]) -> None:
        """Give back spare devices leased and not used."""
        for s, p in places.items():
            for w in [m.worker for m in p.members] or [p.worker]:
                self.release_on(w, [s], "releasing spare devices")

    def release_all(self) -> None:
        """Every device lease of the job goes (its end, or a resume taking over); best effort."""
        try:
            self.term.leases().release(self.spec.job)
        except (StoreError, AllocationError, NotLeader) as exc:
            self.log.warning("job.release_failed", error=str(exc))
