"""Firing a chaos scenario's faults: each when the job reaches its step or time, healed in its turn.

:class:`FaultScheduler` fires each scheduled fault (:class:`~rallypoint.chaos.scenario.FaultSpec`)
through the scenario's :class:`~rallypoint.chaos.injectors.Injectors` once the job has done its
``at_step`` (as the :class:`~rallypoint.chaos.follower.ScenarioFollower` counts the steps) or the
run has lasted its ``at_s``, and heals it after its ``duration_s`` or once the job reaches its
``until_step``; a fault still in force when the job ends is healed then. ``faults`` keeps a
record of each (the report's ``faults``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from rallypoint.basics.errors import RallypointError
from rallypoint.chaos.follower import ScenarioFollower
from rallypoint.chaos.injectors import InjectionError, Injectors
from rallypoint.chaos.scenario import FaultSpec


class FaultScheduler:
    """Fires and heals a scenario's faults (see the module doc).

    Args:
        injectors: what fires and heals each fault.
        job: the follower of the scenario's job: its steps done, and the record of each suspend asked.
        done: set when the run ends; no fault is fired after it.
        say: where the harness's progress events go.
    """

    def __init__(self, injectors: Injectors, job: ScenarioFollower, *, done: threading.Event,
                 say: Callable[[dict[str, Any]], None]) -> None:
        self.injectors, self.job, self.done, self.say = injectors, job, done, say
        self.faults: list[dict[str, Any]] = []

    def run(self, schedule: list[FaultSpec], t0: float) -> None:
        """Fire and heal ``schedule`` until the run ends (``t0``: its start, monotonic)."""
        pending = sorted(schedule, key=lambda f: (f.at_s if f.at_s is not None else 0.0, f.at_step or 0))
        # (the fault, its monotonic deadline, its record, its heal): due at the deadline or at the fault's until_step
        heals: list[tuple[FaultSpec, float, dict[str, Any], Callable[[], dict[str, Any]]]] = []
        healing: list[threading.Thread] = []
        try:
            while not self.done.is_set() and (pending or heals):
                now = time.monotonic() - t0
                for f in [f for f in pending if (f.at_step is not None and self.job.completed >= f.at_step)
                          or (f.at_s is not None and now >= f.at_s)]:
                    pending.remove(f)
                    rec: dict[str, Any] = {"kind": f.kind, "target": f.target, "origin": f.origin, "at": time.time(),
                                           "step": self.job.completed, "healed_at": None, "scheduled": f.describe()}
                    sp: dict[str, Any] | None = None
                    if f.kind == "suspend":  # kept before it is asked: the job may end suspended before fire returns
                        sp = {"asked_at": rec["at"], "asked_step": self.job.completed,
                              "resume_after_s": f.resume_after_s, "suspended_at": None, "resumed_at": None,
                              "resumed_from": None}
                        self.job.expect_suspend(sp)
                    try:
                        detail, heal = self.injectors.fire(f)
                        if sp is not None:
                            sp["state_when_asked"] = detail.get("state_when_asked")
                        rec["worker"] = detail.get("worker", detail.get("coordinator", ""))
                        rec["detail"] = detail
                        if heal is not None:
                            heals.append((f, time.monotonic() + f.duration_s, rec, heal))
                    except (InjectionError, OSError, RallypointError) as exc:
                        rec["error"] = str(exc)
                        if sp is not None:
                            sp["error"] = str(exc)
                    self.faults.append(rec)
                    self.say({"event": "chaos.fault", **{k: v for k, v in rec.items() if k != "detail"}})
                for h in [h for h in heals if (self.job.completed >= h[0].until_step if h[0].until_step is not None
                                               else time.monotonic() >= h[1])]:
                    heals.remove(h)
                    # Each heal in its own thread: one that waits (a hung worker re-registering
                    # behind a partition) must not delay the faults and heals after it.
                    th = threading.Thread(target=self._heal, args=h[2:], name=f"heal-{h[0].kind}", daemon=True)
                    th.start()
                    healing.append(th)
                self.done.wait(0.05)
        finally:
            for _, _, rec, heal in heals:  # the job ended first: undo what is still in force
                self._heal(rec, heal)
            for th in healing:
                th.join(timeout=30)

    def _heal(self, rec: dict[str, Any], heal: Callable[[], dict[str, Any]]) -> None:
        try:
            rec["detail"] = {**rec.get("detail", {}), **heal()}
        except (OSError, RallypointError) as exc:
            rec["detail"] = {**rec.get("detail", {}), "heal_error": str(exc)}
        rec["healed_at"] = time.time()
        self.say({"event": "chaos.healed", "kind": rec["kind"], "target": rec["target"]})
