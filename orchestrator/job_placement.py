"""Placing a job: device leases for every virtual slice, and room taken from lower-priority jobs.

:class:`JobPlacement` places each slice (the largest first) with a device lease; a slice
that finds no free room asks lower-priority jobs to yield slices (the pure policy
:func:`rallypoint.recovery.fairness.plan_preemption`), waits for them to be freed (up to
the job's ``wait_timeout_s``) and leases them. The yield requests are withdrawn once the
job is placed (or ended): the jobs that yielded may then take devices back.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

from rallypoint.etcd.cluster_view import job_records, read_cluster
from rallypoint.basics.errors import NoSpareDevices, NotLeader, StoreError
from rallypoint.etcd.store import Delete, Put
from rallypoint.orchestrator.devices import Placement
from rallypoint.orchestrator.job_drains import JobDrains
from rallypoint.orchestrator.job_state import FINAL_RECORD_STATES, JobFailed
from rallypoint.orchestrator.placement import SlicePlace
from rallypoint.recovery.fairness import Holding, NoVictims, plan_preemption
from rallypoint.recovery.remap import eligible


class JobPlacement(JobDrains):
    """A job's placement (see the module doc); the executor adds the rest of the lifecycle."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._asked: list[str] = []  # yield requests this job put (while it places itself)

    def _place(self) -> None:
        leases = self.leases()
        for s in sorted(self.spec.slices, key=lambda s: -self.devices_of(s.slice)):
            try:
                p = leases.allocate(self.spec.job, s.slice, self.devices_of(s.slice))
            except NoSpareDevices:
                p = self._take_from_lower_priority(s.slice)
            self.placement[s.slice] = SlicePlace(p.worker, "", p.incarnation, p.devices)
        snap = read_cluster(self.store, self.keys)
        for name, p in self.placement.items():
            w = snap.workers.get(p.worker)
            if w is None or w.info.incarnation != p.incarnation:
                raise JobFailed(f"worker {p.worker} holding slice {name!r} was lost while the job was being placed")
            self.placement[name] = SlicePlace(p.worker, w.info.address, p.incarnation, p.devices, w.info.data_address)
        self.event("job.placed", **{s: {"worker": p.worker, "incarnation": p.incarnation, "devices": list(p.devices)}
                                    for s, p in self.placement.items()})

    def _take_from_lower_priority(self, slice_name: str) -> Placement:
        """No free room for the slice: ask lower-priority jobs to yield slices (``recovery.fairness``), then lease.

        Raises the original :class:`NoSpareDevices` when no lower-priority slice makes room.
        """
        assert self.settings is not None
        need = self.devices_of(slice_name)
        snap = read_cluster(self.store, self.keys)
        priorities = {j: int(r.get("priority", 0)) for j, r in job_records(self.store, self.keys).items()
                      if r.get("state") not in FINAL_RECORD_STATES}
        holdings = [Holding(job, sl, w, n, priorities[job])
                    for w, ws in snap.workers.items()
                    for (job, sl), n in Counter((h.job, h.slice) for h in ws.holders.values()).items()
                    if job != self.spec.job and job in priorities]
        free = {w: len(ws.free) for w, ws in snap.workers.items() if eligible(w, ws, snap)}
        plan = plan_preemption({slice_name: need}, priority=self.spec.priority, free=free, holdings=holdings)
        if isinstance(plan, NoVictims):
            largest = max(free.values(), default=0)
            raise NoSpareDevices(self.spec.job, slice_name, need, largest)
        asked = [self.keys.yield_slice(v.job, v.slice) for v in plan.victims]
        why = json.dumps({"for": self.spec.job, "priority": self.spec.priority, "slice": slice_name, "at": time.time()})
        self.writer.txn([], [Put(k, why) for k in asked])
        victims = [f"{v.job}/{v.slice} (priority {v.priority}, on {v.worker})" for v in plan.victims]
        self.log.warning("job.preempting", slice=slice_name, victims=victims)
        self.event("job.waiting", reason=f"no free room for slice {slice_name!r} ({need} devices): taking "
                   f"{', '.join(victims)} from lower-priority jobs", missing={slice_name: need}, victims=victims)
        self._asked += asked
        leases = self.leases()
        t0 = self.clock.monotonic()
        while True:
            self.hold_term()
            try:
                return leases.allocate(self.spec.job, slice_name, need)
            except NoSpareDevices:
                if self.clock.monotonic() - t0 > self.settings.wait_timeout_s:
                    raise JobFailed(f"slice {slice_name!r}: the lower-priority slices asked to yield ({', '.join(victims)})"
                                    f" did not free {need} devices within wait_timeout_s="
                                    f"{self.settings.wait_timeout_s:g}") from None
                self.clock.sleep(0.1)

    def _withdraw_yields(self) -> None:
        """Placed (or ended): the lower-priority jobs may take devices back."""
        if self._asked:
            try:
                self.writer.txn([], [Delete(k) for k in self._asked])
                self._asked = []
            except (StoreError, NotLeader) as exc:
                self.log.warning("job.withdraw_failed", error=str(exc))
