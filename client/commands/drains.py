"""Draining a worker from outside: ``rallypoint drain WORKER`` and the ``drain:`` fault.

:func:`begin_drain` checks that the drain can work (the worker is registered; every
slice on it finds a spare) before it changes anything, then cordons the worker and
puts the request (:mod:`rallypoint.etcd.drains`); the leaders' executors carry it out
(``orchestrator/job/drain.py``). :func:`wait_drained` follows it to its end, and
:func:`end_drain` removes the request (and, when a job cancelled it, the cordon this
drain put), so a cancelled drain leaves the cluster as it found it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.etcd.drains import DrainRequest, DrainResult, read_drain_results, request_drain
from rallypoint.basics.errors import RallypointError
from rallypoint.etcd.keys import Keys, check_name
from rallypoint.etcd.store import Store
from rallypoint.orchestrator import api
from rallypoint.recovery.remap import Remap, RemapPolicy, plan_remap


class DrainRefused(RallypointError):
    """The drain cannot work; nothing was changed."""


@dataclass
class DrainOutcome:
    state: str  # "done", "cancelled" or "timed_out"
    held: dict[str, int]  # job/slice -> devices still held on the worker
    results: dict[str, DrainResult] = field(default_factory=dict)
    waited_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "held": self.held, "waited_s": round(self.waited_s, 3),
                "jobs": {j: {"state": r.state, "reason": r.reason, **r.record} for j, r in self.results.items()}}


def held_slices(store: Store, keys: Keys, worker: str) -> dict[str, int]:
    """``job/slice`` -> devices of ``worker`` it holds."""
    snap = read_cluster(store, keys)
    ws = snap.workers.get(worker)
    if ws is None:
        return {}
    return dict(Counter(f"{h.job}/{h.slice}" for h in ws.holders.values()))


def begin_drain(store: Store, keys: Keys, worker: str, *, by: str, deadline_s: float = 0.0) -> tuple[DrainRequest, bool]:
    """Check, cordon, request. Returns the request and whether this call cordoned the worker
    (the jobs it waits on: :func:`held_slices` before the call).

    Raises:
        DrainRefused: the worker is not registered, or some slice on it finds no spare (nothing changed).
    """
    check_name("worker", worker)
    snap = read_cluster(store, keys)
    ws = snap.workers.get(worker)
    if ws is None:
        raise DrainRefused(f"no worker {worker!r} is registered in cluster {keys.cluster!r}; see `rallypoint workers`")
    need = dict(Counter(f"{h.job}/{h.slice}" for h in ws.holders.values()))
    if need:
        decision = plan_remap(snap, need, RemapPolicy(on_no_spare="fail"), exclude=frozenset({worker}))
        if not isinstance(decision, Remap):
            reason = getattr(decision, "reason", "").replace("lost slice", "slice")
            raise DrainRefused(f"cannot drain worker {worker}: {reason}. Nothing was changed")
    cordoned_now = not ws.cordoned
    if cordoned_now:
        api.cordon(store, keys, worker, by="drain")
    req = request_drain(store, keys, worker, reason="operator", by=by, deadline_s=deadline_s)
    return req, cordoned_now


def wait_drained(store: Store, keys: Keys, req: DrainRequest, *, timeout_s: float, poll_s: float = 0.2,
                 jobs: frozenset[str] = frozenset(), answer_grace_s: float = 10.0) -> DrainOutcome:
    """Until the worker holds no device lease (done), a job cancels the drain, or ``timeout_s`` passes.

    Once the worker is free, waits up to ``answer_grace_s`` more for the answer of each of
    ``jobs`` (a job answers after its slices ran again on the spare; one that ended
    instead of draining never answers).
    """
    t0 = time.monotonic()
    free_at: float | None = None
    while True:
        held = held_slices(store, keys, req.worker)
        results = read_drain_results(store, keys, req.worker, req.revision)
        waited = time.monotonic() - t0
        if any(r.state == "cancelled" for r in results.values()):
            return DrainOutcome("cancelled", held, results, waited)
        if not held:
            free_at = time.monotonic() if free_at is None else free_at
            if jobs <= set(results) or time.monotonic() - free_at >= answer_grace_s:
                return DrainOutcome("done", held, results, waited)
        else:
            free_at = None
        if held and waited >= timeout_s:
            return DrainOutcome("timed_out", held, results, waited)
        time.sleep(poll_s)


def end_drain(store: Store, keys: Keys, req: DrainRequest, outcome: DrainOutcome, *, cordoned_now: bool) -> None:
    """Remove the request; a cancelled drain also takes back the cordon it put."""
    store.delete(keys.drain(req.worker))
    if outcome.state == "cancelled" and cordoned_now:
        api.uncordon(store, keys, req.worker)
