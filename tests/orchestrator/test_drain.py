"""The drain state machine against a fake job: its transitions, cancellations and aborts (pure logic)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from rallypoint.basics.clock import FakeClock
from rallypoint.etcd.drains import DrainRequest
from rallypoint.orchestrator.job.drain import TRANSITIONS, Drain, DrainPhase, DrainPort
from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.recovery.load_plan import SlicePlace

D = DrainPhase


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    warning = info


class FakeJob(DrainPort):
    def __init__(self, *, spares: bool = True, checkpoints: bool = True) -> None:
        self.placement = {"a": SlicePlace("w1", "w1:1", 7, (0,)), "b": SlicePlace("w2", "w2:1", 8, (0,)),
                          "c": SlicePlace("w1", "w1:1", 7, (1,))}
        self.spares, self.checkpoints = spares, checkpoints
        self.granted, self.done_at, self.calls = 12, 0, []  # type: ignore[var-annotated]
        self.move_fails: WorkerCallFailed | None = None
        self.room: dict[str, SlicePlace] | None = None

    def drain_step(self) -> int:
        return self.granted

    def why_not_drainable(self, slices: list[str]) -> str:
        return "" if self.checkpoints else "no checkpoints"

    def lease_spares(self, need: Mapping[str, int], exclude: frozenset[str]) -> dict[str, SlicePlace] | str:
        self.calls.append(("lease", dict(need), exclude))
        if not self.spares:
            return "no spare has 1 free device"
        return {s: SlicePlace("w9", "w9:1", 9, (i,)) for i, s in enumerate(sorted(need))}

    def release_spares(self, places: Mapping[str, SlicePlace]) -> None:
        self.calls.append(("release", sorted(places)))

    def hold(self, worker: str, step: int | None) -> None:
        self.calls.append(("hold", worker, step))

    def reached(self, slices: list[str], step: int) -> bool:
        return self.done_at >= step

    def move(self, worker: str, places: Mapping[str, SlicePlace], step: int) -> None:
        self.calls.append(("move", worker, sorted(places), step))
        if self.move_fails is not None:
            raise self.move_fails
        self.placement.update(places)

    def park(self, worker: str, slices: list[str], step: int) -> None:
        self.calls.append(("park", worker, slices, step))

    def room_for(self, need: Mapping[str, int], slices: list[str]) -> dict[str, SlicePlace] | None:
        self.calls.append(("room", dict(need)))
        return self.room

    def loaded_workers(self) -> list[str]:
        return ["w1", "w2"]


def drain(job: FakeJob, worker: str = "w1") -> Drain:
    return Drain(job, 1, DrainRequest(worker, "operator", "test", 0.0, 0.0, revision=41), clock=FakeClock(), log=Log())


def test_a_drain_holds_the_worker_at_the_grant_waits_for_the_save_then_moves_every_slice_of_it() -> None:
    job = FakeJob()
    d = drain(job)
    assert d.step() is D.SAVING
    assert job.calls[0] == ("lease", {"a": 1, "c": 1}, frozenset({"w1", "w2"}))
    assert job.calls[1] == ("hold", "w1", 12) and d.record.step == 12 and d.record.slices == ["a", "c"]
    assert d.step() is D.SAVING  # the worker has not reached step 12 yet
    d.observe("w1", "a", 11)  # the slice's last instance below the drain step
    job.done_at = 12
    assert d.step() is D.RESUMING
    assert job.calls[-1] == ("move", "w1", ["a", "c"], 12)
    d.observe("w2", "b", 12)  # not a moved slice
    assert d.step() is D.RESUMING
    d.observe("w9", "c", 12)
    assert d.step() is D.DONE
    out = d.record.to_json()
    assert out["moved"] == {"a": "w9", "c": "w9"} and out["state"] == "done" and out["replayed_instances"] == 0
    assert out["paused_s"] is not None and out["save_s"] is not None and out["move_s"] is not None


def test_a_loss_after_the_move_leaves_the_drain_done_with_its_pause_unmeasured() -> None:
    job = FakeJob()
    d = drain(job)
    d.step()
    job.done_at = 12
    assert d.step() is D.RESUMING
    d.abort("recovery 1 started")
    assert d.phase is D.DONE and "not measured" in d.record.detail
    assert d.record.to_json()["paused_s"] is None
    assert not any(c[0] == "release" for c in job.calls)


@pytest.mark.parametrize(("kw", "why"), [({"spares": False}, "cannot drain worker w1: no spare"),
                                         ({"checkpoints": False}, "no checkpoints")])
def test_a_drain_that_cannot_work_is_cancelled_before_it_changes_anything(kw: dict[str, bool], why: str) -> None:
    job = FakeJob(**kw)
    d = drain(job)
    assert d.step() is D.CANCELLED
    assert why in d.record.detail
    assert not [c for c in job.calls if c[0] in ("hold", "move")]


def test_a_worker_without_slices_of_the_job_is_not_drained_by_it() -> None:
    job = FakeJob()
    assert drain(job, "w7").step() is D.CANCELLED
    assert job.calls == []


def test_an_aborted_drain_gives_back_its_spares_and_lifts_the_hold() -> None:
    job = FakeJob()
    d = drain(job)
    d.step()
    d.abort("recovery 1 started")
    assert d.phase is D.ABORTED and d.record.detail == "recovery 1 started"
    assert ("release", ["a", "c"]) in job.calls and job.calls[-1] == ("hold", "w1", None)
    d.abort("again")  # idempotent once over
    assert d.record.detail == "recovery 1 started"


def test_a_failed_move_raises_to_the_executor_and_keeps_the_spares_it_placed() -> None:
    import grpc

    job = FakeJob()
    job.move_fails = WorkerCallFailed("w9", "LoadJob", grpc.StatusCode.UNAVAILABLE, "connection refused")
    d = drain(job)
    d.step()
    job.done_at = 99
    with pytest.raises(WorkerCallFailed):
        d.step()
    assert d.phase is D.MOVING
    d.abort(str(job.move_fails))
    assert not any(c[0] == "release" for c in job.calls)  # the spares now hold the job's slices


def test_every_transition_the_machine_takes_is_declared() -> None:
    assert all(p.is_terminal == (not TRANSITIONS[p]) for p in D)
    job = FakeJob()
    d = drain(job)
    with pytest.raises(AssertionError, match="no transition saving -> done"):
        d.phase = D.SAVING
        d._set(D.DONE)


def test_a_yield_parks_the_slice_without_a_spare_then_moves_it_once_room_returns() -> None:
    job = FakeJob(spares=False)
    d = Drain(job, 1, DrainRequest("w1", "yield", "job high", 0.0, 0.0), clock=FakeClock(), log=Log(), only=["a"],
              park=True)
    assert d.step() is D.SAVING and not any(c[0] == "lease" for c in job.calls)
    job.done_at = 12
    assert d.step() is D.PARKED and ("park", "w1", ["a"], 12) in job.calls and d.parked == ["a"]
    assert d.step() is D.PARKED  # no room yet
    job.room = {"a": SlicePlace("w5", "w5:1", 3, (0,))}
    assert d.step() is D.RESUMING and job.calls[-1] == ("move", "w1", ["a"], 12) and d.parked == []
    d.observe("w5", "a", 12)
    assert d.step() is D.DONE and d.record.to_json()["paused_s"] is not None


def test_an_aborted_park_leaves_its_slices_for_the_recovery() -> None:
    job = FakeJob()
    d = Drain(job, 1, DrainRequest("w1", "yield", "job high", 0.0, 0.0), clock=FakeClock(), log=Log(), park=True)
    d.step()
    job.done_at = 12
    d.step()
    assert d.parked == ["a", "c"]
    d.abort("recovery 1 started")
    assert d.phase is D.ABORTED and not any(c[0] == "release" for c in job.calls)


def test_a_drained_member_of_a_gang_moves_the_gang_whole_through_its_lead_onto_workers_it_does_not_share() -> None:
    # Slice "g" spans w2 (its lead) and w5; w5 is drained. The drain holds, saves and unloads the lead, and the new
    # gang may use neither old member nor the drained worker (docs/multihost.md).
    job = FakeJob()
    job.placement["g"] = SlicePlace("w2", "w2:1", 8, (1,), members=(SlicePlace("w2", "w2:1", 8, (1,)),
                                                                    SlicePlace("w5", "w5:1", 3, (0,))))
    d = drain(job, "w5")
    assert d.step() is D.SAVING and d.record.slices == ["g"] and d.lead == "w2"
    assert job.calls[0] == ("lease", {"g": 2}, frozenset({"w1", "w2", "w5"}))
    assert job.calls[1] == ("hold", "w2", 12)
    d.observe("w2", "g", 11)
    job.done_at = 12
    assert d.step() is D.RESUMING and job.calls[-1] == ("move", "w2", ["g"], 12)
    d.abort("a loss")  # moved already: done, only the pause unmeasured; the hold was the lead's
    assert d.phase is D.DONE and ("hold", "w5", None) not in job.calls
