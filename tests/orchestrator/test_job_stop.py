"""Suspend and cancel, one executor step at a time (MemoryStore, FakeWorkers, FakeClock): the job stops at a
step boundary with every slice saved there, releases every device, and ends SUSPENDED or CANCELLED through its
transition table; tests/integration/test_lifecycle.py runs the same on a real cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rallypoint.orchestrator.job.record import EVENTS_FILE
from rallypoint.orchestrator.job.state import RECORD_TRANSITIONS, TRANSITIONS, JobState, JobStateError, \
    record_transition
from rallypoint.orchestrator.job.stop import JobStop, StopRequest
from rallypoint.proto import rallypoint_pb2 as pb
from tests.fakes import FakeLog
from tests.helpers.executor import Harness, pipeline_spec


class AskAt(list[pb.JobEvent]):
    """The executor's event list; at ``step.done`` of ``step`` it hands the executor ``request`` (as the service
    does from a gRPC thread), once."""

    def __init__(self, step: int, request: StopRequest, h: Any = None) -> None:
        super().__init__()
        self.step, self.request, self.h = step, request, h
        self.on = "step.done"
        self.kill: tuple[int, Any] | None = None

    def append(self, ev: pb.JobEvent) -> None:
        super().append(ev)
        if self.kill is not None and ev.event == "step.done" and ev.step == self.kill[0]:
            self.kill[1]()
            self.kill = None
        if ev.event == self.on and (ev.step == self.step or self.on != "step.done") and self.h is not None:
            self.h.x.request_stop(self.request)  # as the service hands it over (JobHandle)
            self.h = None


def harness(tmp_path: Path, at: int, request: StopRequest) -> tuple[Harness, AskAt]:
    events = AskAt(at, request)
    h = Harness(tmp_path, events=events)
    events.h = h
    return h, events


def test_every_new_state_has_its_moves_in_the_tables() -> None:
    S = JobState
    assert S.STOPPING in TRANSITIONS[S.RUNNING] and TRANSITIONS[S.STOPPING] >= {S.SUSPENDED, S.CANCELLED, S.RECOVERING}
    assert S.SUSPENDED not in TRANSITIONS[S.RUNNING]  # a suspend always saves first: through STOPPING
    assert all(S.CANCELLED in TRANSITIONS[s] for s in (S.PLACING, S.LOADING, S.RUNNING, S.RECOVERING, S.FINISHING))
    assert TRANSITIONS[S.SUSPENDED] == TRANSITIONS[S.CANCELLED] == frozenset()  # the executor ends there
    assert RECORD_TRANSITIONS[S.SUSPENDED] == {S.CANCELLED, S.PLACING}
    record_transition("cancelled", S.PLACING, "j")  # a resume of a cancelled run
    with pytest.raises(JobStateError, match="job 'j' is succeeded: it cannot become placing"):
        record_transition("succeeded", S.PLACING, "j")
    with pytest.raises(JobStateError, match="no state of a job"):
        record_transition("paused", S.CANCELLED, "j")


def test_a_suspend_saves_every_slice_at_the_next_boundary_releases_every_device_and_ends_suspended(
    tmp_path: Path,
) -> None:
    req = StopRequest("suspend", by="operator ann", reason="maintenance")
    h, events = harness(tmp_path, 6, req)
    h.store.put(h.keys.control("pipe"), json.dumps(req.to_json()))  # as the service keeps it
    assert h.x.run() is JobState.SUSPENDED
    stopping = next(e for e in events if e.event == "job.stopping")
    boundary = json.loads(stopping.detail)["boundary"]
    assert 7 <= boundary <= 9  # the grant when it was asked: no instance of it had started anywhere
    assert h.x.progress.completed == boundary and h.x.progress.cut == boundary  # every slice committed the boundary
    for s in ("s0", "s1"):
        assert h.store.get(h.keys.checkpoint("pipe", s, boundary)) is not None
    end = events[-1]
    assert end.event == "job.suspended" and json.loads(end.detail)["cut"] == boundary
    assert "by operator ann: maintenance" in json.loads(end.detail)["reason"]
    rec = h.record()
    assert rec["state"] == "suspended" and rec["cut"] == boundary and rec["stop"]["by"] == "operator ann"
    assert rec["ended_at"] >= rec["started_at"] > 0
    assert h.leases() == [] and sorted(h.workers.unloaded) == sorted({h.worker_of("s0"), h.worker_of("s1")})
    assert h.store.get(h.keys.control("pipe")) is None  # carried out: gone with the final record
    assert h.x.recovery.records == []  # nothing lost, nothing to replay
    logged = [json.loads(line) for line in (h.x.run_dir / EVENTS_FILE).read_text().splitlines()]
    assert [e["event"] for e in logged] == ["job.placed", "job.started", "job.stopping", "job.suspended"]


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_cancel_ends_cancelled_at_a_saved_boundary_or_at_once_without_a_checkpoint(tmp_path: Path,
                                                                                   checkpoint: bool) -> None:
    h, events = harness(tmp_path, 6, StopRequest("cancel", checkpoint=checkpoint, by="operator bo"))
    assert h.x.run() is JobState.CANCELLED
    names = [e.event for e in events if e.event != "step.done"]
    assert names[-1] == "job.cancelled" and ("job.stopping" in names) is checkpoint
    rec = h.record()
    assert rec["state"] == "cancelled" and rec["stop"]["checkpoint"] is checkpoint and h.leases() == []
    if checkpoint:
        assert rec["cut"] == h.x.progress.completed > 6
    else:
        assert rec["cut"] == 5 and "without a final checkpoint" in rec["reason"]  # the last scheduled commit


def test_a_suspend_asked_during_a_recovery_waits_for_it_and_then_saves_at_a_boundary(tmp_path: Path) -> None:
    h, events = harness(tmp_path, -1, StopRequest("suspend", by="operator cy"))
    events.on = "job.recovering"  # asked as the recovery starts
    events.kill = (6, lambda: h.workers.end(h.worker_of("s1")))  # its process dies after step 6
    assert h.x.run() is JobState.SUSPENDED
    assert not h.x.stopper.request(StopRequest("cancel", by="operator dee"))  # the first request stands
    assert len(h.x.recovery.records) == 1 and h.x.recovery.active is None
    names = h.names()
    assert names.index("job.recovering") < names.index("job.recovered") < names.index("job.stopping")
    assert h.record()["state"] == "suspended" and h.leases() == []


def test_a_stop_asked_when_every_step_is_granted_lets_the_job_finish(tmp_path: Path) -> None:
    req = StopRequest("suspend", by="operator ed")
    h, _events = harness(tmp_path, 19, req)
    h.store.put(h.keys.control("pipe"), json.dumps(req.to_json()))
    assert h.x.run() is JobState.SUCCEEDED
    assert h.store.get(h.keys.control("pipe")) is None  # moot: it goes with the final record


def test_a_new_leader_adopting_a_job_carries_out_the_stop_its_record_asks(tmp_path: Path) -> None:
    first = Harness(tmp_path)
    first.x.begin()
    first.steps_until(4)
    first.x.record()
    req = StopRequest("suspend", by="operator fay")
    first.store.put(first.keys.control("pipe"), json.dumps(req.to_json()))  # the old leader took it, then died
    first.election.depose()
    second = Harness(tmp_path, store=first.store, adopted=True)
    assert second.x.run() is JobState.SUSPENDED
    assert second.record()["stop"]["by"] == "operator fay" and second.store.get(second.keys.control("pipe")) is None


def test_a_higher_priority_job_asking_for_every_slice_suspends_the_job_to_resume_by_itself(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    h.steps_until(4)
    why = json.dumps({"for": "urgent", "priority": 9, "slice": "only"})
    for s in ("s0", "s1"):
        h.store.put(h.keys.yield_slice("pipe", s), why)
    with pytest.raises(Exception) as stopped:
        for _ in range(500):
            h.clock.advance(0.6)  # the drain poll's period
            h.x.step(timeout_s=0.0)
    assert stopped.value.state is JobState.SUSPENDED  # type: ignore[attr-defined]
    assert not any(e.event == "job.yielded" for e in h.events)  # suspended whole, not parked slice by slice
    req = h.x.stopper.pending
    assert req is not None and req.auto_resume and req.by == "job urgent (priority 9)"
    assert json.loads(h.store.get(h.keys.control("pipe")).value)["auto_resume"] is True  # type: ignore[union-attr]


def test_a_resume_places_a_slice_declared_min_max_on_the_most_devices_free_for_it(tmp_path: Path) -> None:
    from rallypoint.orchestrator.job.executor import JobExecutor
    from tests.fakes import FakeElection, FakeWorkers, MemoryStore, register_worker

    spec = pipeline_spec()
    spec.slices[0].mesh_shape[:] = [2]  # s0 declares devices=(1, 2): its programs exist for 1 device too
    spec.nodes[0].variants.add(devices=1, mesh_shape=[1])
    spec.states[0].init_variants.add(devices=1, mesh_shape=[1])
    store = MemoryStore()
    events = AskAt(6, StopRequest("suspend", by="operator gus"))
    h = Harness(tmp_path, spec=spec, store=store, events=events)
    events.h = h
    for w, n in (("w0", 2), ("w1", 1), ("w2", 1), ("w3", 1)):
        register_worker(store, h.keys, w, n)
    assert h.x.run() is JobState.SUSPENDED and h.x.places.slices["s0"].count == 2
    store.put(h.keys.cordon("w0"), "{}")  # only one-device workers are free now
    election = FakeElection(store, h.keys, h.clock)
    resumed: list[pb.JobEvent] = []
    x = JobExecutor(spec, store=store, keys=h.keys, election=election, emit=resumed.append, clock=h.clock,
                    checkpoint_root=str(tmp_path), resume=True, loss_grace_s=0.0,
                    workers=FakeWorkers(spec.job, spec, store, h.keys))
    assert x.run() is JobState.SUCCEEDED
    assert x.places.slices["s0"].count == 1 and x.places.slices["s0"].worker != "w0"
    (change,) = x.places.resharded
    assert change.devices_before == 2 and change.devices_after == 1 and "resumed" in change.why
    done = json.loads(resumed[-1].detail)
    assert resumed[-1].event == "job.finished" and done["exact"] is False  # within the reshard tolerance
    (back,) = [e for e in resumed if e.event == "job.resumed"]
    assert back.step == json.loads(events[-1].detail)["cut"] == done["start_step"]


class _Progress:
    granted, completed, all_granted = 7, 5, False


class _Drains:
    drains: dict[str, Any] = {}

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)


class _Recovery:
    active = None


def _stop(interrupts: list[BaseException], moves: list[Any], events: list[str], drains: _Drains) -> JobStop:
    """A JobStop alone: its interrupt is noted, not yet seen by a loop."""
    return JobStop("j", placed=lambda: {"s0": "w0"}, progress=_Progress(), drains=drains, recovery=_Recovery(),
                   interrupt=interrupts.append, set_state=lambda *a, **k: moves.append(a),
                   event=lambda name, **k: events.append(name), log=FakeLog())


def test_a_cancel_without_a_checkpoint_never_begins_a_boundary_stop_even_before_its_interrupt_lands() -> None:
    # The service's thread takes the request, then interrupts the term; the executor's loop may look in between
    # (seen on a loaded machine: job.stopping, then job.cancelled). That look must not begin a boundary stop.
    interrupts: list[BaseException] = []
    moves: list[Any] = []
    events: list[str] = []
    drains = _Drains()
    stop = _stop(interrupts, moves, events, drains)
    assert stop.request(StopRequest("cancel", by="operator dee"))
    assert len(interrupts) == 1
    assert stop.check(JobState.RUNNING) is None  # no hold: nothing waits for a boundary
    assert moves == [] and events == [] and drains.aborted == [] and stop.boundary is None
    # A cancel with a final checkpoint does begin one, at the grant.
    saving = _stop(interrupts, moves, events, drains)
    assert saving.request(StopRequest("cancel", checkpoint=True, by="operator dee"))
    hold = saving.check(JobState.RUNNING)
    assert hold is not None and hold.step == 7 and hold.workers == ("w0",) and events == ["job.stopping"]
    assert len(interrupts) == 1  # it interrupted nothing
