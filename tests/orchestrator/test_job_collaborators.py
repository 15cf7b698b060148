"""The executor's collaborators one at a time, each against a MemoryStore (one test: a real etcd), a FakeElection and
fakes of its peers.

No executor is built here: each collaborator takes only what it acts through (the term,
the placement, the loads, the progress), as the executor wires them.
"""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import pytest

from rallypoint.basics.clock import FakeClock
from rallypoint.basics.errors import NoSpareDevices, StoreUnavailable
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.etcd.drains import DrainRequest
from rallypoint.etcd.keys import Keys
from rallypoint.orchestrator.job.cut import JobCut
from rallypoint.orchestrator.job.drains import DrainsStep, JobDrains
from rallypoint.orchestrator.job.grants import Hold
from rallypoint.orchestrator.job.loads import JobLoads
from rallypoint.orchestrator.job.placement import JobPlacement
from rallypoint.orchestrator.job.ports import JobRecoveryPort, JobStragglerPort
from rallypoint.orchestrator.job.progress import JobProgress, LogFloor
from rallypoint.orchestrator.job.recovery import JobSettings, RecoveryRecord
from rallypoint.recovery.decide import Budget, Fail
from rallypoint.recovery.remap import NoRoom
from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.orchestrator.job.state import HandedOff, JobFailed
from rallypoint.orchestrator.job.term import JobTerm
from rallypoint.recovery.load_plan import SlicePlace
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.replay import Graph
from rallypoint.recovery.stragglers import Probation, StragglerSettings, probation
from tests.fakes import FakeElection, FakeLog, FakeWorkers, MemoryStore, call_failed, register_worker
from tests.helpers.executor import pipeline_spec


class Parts:
    """The collaborators of one job, wired as the executor wires them, over three registered workers."""

    def __init__(self, workers: int = 3) -> None:
        self.keys, self.store, self.clock, self.log = Keys("t"), MemoryStore(), FakeClock(), FakeLog()
        for i in range(workers):
            register_worker(self.store, self.keys, f"w{i}", 1)
        self.election = FakeElection(self.store, self.keys, self.clock)
        self.spec = pipeline_spec()
        self.graph = Graph.from_spec(self.spec)
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.term = JobTerm("pipe", store=self.store, keys=self.keys, election=self.election, clock=self.clock,
                            log=self.log)
        self.progress = JobProgress(self.spec, self.graph)
        settings = JobSettings.from_spec(self.spec)
        self.places = JobPlacement(self.spec, self.term, clock=self.clock, log=self.log, event=self.event,
                                   settings=settings)
        self.workers = FakeWorkers("pipe", self.spec, self.store, self.keys)
        self.loads = JobLoads(self.spec, self.workers, self.term, self.places.slices, clock=self.clock, log=self.log,
                              settings=settings)
        self.granted: list[list[str]] = []
        self.drains = JobDrains(self.spec, self.graph, term=self.term, placement=self.places, loads=self.loads,
                                progress=self.progress, clock=self.clock, log=self.log, event=self.event,
                                grant=self.granted.append, hold=self.hold, running=lambda: True, record=lambda: None,
                                settings=settings)
        self.drains.open_run(checkpoints=True)

    def hold(self, hold: Hold) -> None:
        """What the executor does with a drain's hold: the grants keep it, the held workers are granted."""
        held = self.progress.grants.hold(hold, self.workers)
        if held:
            self.granted.append(held)

    def event(self, name: str, step: int = 0, **detail: Any) -> None:
        self.events.append((name, {"step": step, **detail}))

    def leases(self) -> list[str]:
        return [kv.key for kv in self.store.get_prefix(self.keys.leases)[0]]


# -- JobTerm ------------------------------------------------------------------------------------------


def test_the_term_hands_off_once_deposed_and_writes_nothing_more() -> None:
    p = Parts()
    p.term.hold()
    p.election.depose()
    with pytest.raises(HandedOff):
        p.term.hold()
    assert not p.term.write_quietly("x.failed", [])


def test_the_term_retries_etcd_calls_through_an_outage_and_says_what_failed_after_it() -> None:
    p = Parts()
    calls = {"n": 0}

    def flaky() -> int:
        calls["n"] += 1
        if calls["n"] < 3:
            raise StoreUnavailable("etcd away")
        return 7

    assert p.term.until_etcd("reading", flaky) == 7 and calls["n"] == 3

    def down() -> int:
        raise StoreUnavailable("etcd away")

    with pytest.raises(JobFailed, match="reading: etcd stayed unreachable"):
        p.term.until_etcd("reading", down)


def test_the_term_sees_a_registration_gone_and_drops_a_commit_in_etcd() -> None:
    p = Parts()
    inc = p.store.get(p.keys.worker("w1")).create_revision
    assert p.term.gone({"w1": inc}) == {} and p.term.registered("w1", {inc})
    p.store.revoke_lease(p.store.get(p.keys.worker("w1")).lease)
    assert "registration is gone" in p.term.gone({"w1": inc})["w1"] and not p.term.registered("w1", {inc})
    c = CheckpointCommit("pipe", "s0", 5, "/ck/s0/5", "x")
    p.store.put(p.keys.checkpoint("pipe", "s0", 5), json.dumps(c.to_json()))
    assert [x.step for x in p.term.commits()["s0"]] == [5]
    p.term.drop_commit("s0", 5)
    assert p.term.commits().get("s0", []) == []


# -- JobPlacement -----------------------------------------------------------------------------------------


def test_placement_leases_every_slice_and_is_read_only_to_everyone_else() -> None:
    p = Parts()
    p.places.place(lambda: read_cluster(p.store, p.keys))
    assert sorted(p.places.slices) == ["s0", "s1"] and len(p.leases()) == 2
    with pytest.raises(TypeError):
        p.places.slices["s0"] = SlicePlace("w9", "", 1, (0,))  # type: ignore[index]
    assert [e for e, _ in p.events] == ["job.placed"]
    p.places.release_all()
    assert p.leases() == []


def record(**kw: Any) -> RecoveryRecord:
    return RecoveryRecord(number=1, lost={}, reasons={}, detected_at=0.0, detected_mono=0.0, detection_s=0.0, **kw)


def test_a_remap_leases_a_spare_and_apply_makes_it_the_slices_place() -> None:
    p = Parts()
    p.places.place(lambda: read_cluster(p.store, p.keys))
    lost = p.places.slices["s1"].worker
    placed, waited_s = p.places.remap({"s1": 1}, frozenset({lost, p.places.slices["s0"].worker}), 1)
    assert waited_s == 0.0  # a spare was there
    assert placed["s1"].worker not in (lost, p.places.slices["s0"].worker)
    assert p.places.slices["s1"].worker == lost  # leased, not yet the job's
    p.places.apply(placed)
    assert p.places.slices["s1"].worker == placed["s1"].worker and p.places.resharded == []


def test_a_remap_with_no_spare_and_on_no_spare_fail_decides_fail_naming_the_slice_and_leases_nothing() -> None:
    p = Parts(workers=2)
    p.places.settings = JobSettings.from_spec(pipeline_spec(on_no_spare="fail"))
    p.places.place(lambda: read_cluster(p.store, p.keys))
    before = p.leases()
    decision = p.places.remap({"s1": 1}, frozenset({"w0", "w1"}), 1)
    assert isinstance(decision, NoRoom) and "s1" in decision.reason  # the recovery carries it out (Failed)
    assert p.leases() == before


def test_adopting_a_slice_without_room_with_on_no_spare_shrink_places_it_on_fewer_devices() -> None:
    p = Parts(workers=2)  # one device each; s1 needs two, and runs on one too
    spec = pipeline_spec(on_no_spare="shrink")
    spec.slices[1].mesh_shape[:] = [2]
    spec.nodes[1].variants.add(devices=1)
    p.places = JobPlacement(spec, p.term, clock=p.clock, log=p.log, event=p.event,
                            settings=JobSettings.from_spec(spec))
    with pytest.raises(NoSpareDevices):  # a new job: no waiting, no shrinking
        p.places.place(lambda: read_cluster(p.store, p.keys))
    p.places.release_all()
    p.places.place(lambda: read_cluster(p.store, p.keys), adopting=True)
    assert len(p.places.slices["s1"].devices) == 1 and len(p.places.slices["s0"].devices) == 1
    assert [(r.slice, r.devices_before, r.devices_after) for r in p.places.resharded] == [("s1", 2, 1)]


@pytest.mark.parametrize(("policy", "why"), [({"on_no_spare": "fail"}, "on_no_spare='fail'"),
                                             ({"wait_timeout_s": 1}, "of wait_timeout_s=1")])
def test_adopting_a_slice_without_room_it_may_not_wait_for_returns_fail_saying_why(policy: dict[str, Any],
                                                                                  why: str) -> None:
    """The placement decides (Fail, with why); the executor fails the job. A placement that raised JobFailed
    itself, or placed the slice anyway, fails here."""
    p = Parts(workers=1)  # one device: s0 takes it, s1 finds no room
    spec = pipeline_spec(**policy)
    p.places = JobPlacement(spec, p.term, clock=p.clock, log=p.log, event=p.event,
                            settings=JobSettings.from_spec(spec))
    decision = p.places.place(lambda: read_cluster(p.store, p.keys), adopting=True)
    assert isinstance(decision, NoRoom) and why in decision.reason and "s1" in decision.reason
    assert "s1" not in p.places.slices and not any(name == "job.placed" for name, _ in p.events)


# -- JobDrains ----------------------------------------------------------------------------------------------


def loaded(p: Parts) -> None:
    p.places.place(lambda: read_cluster(p.store, p.keys))
    assert p.loads.load(None, 0, {}) == {}
    p.progress.widen(2)


def test_a_drain_whose_move_fails_returns_the_lost_worker_to_the_executor_instead_of_recovering() -> None:
    p = Parts()
    loaded(p)
    victim = p.places.slices["s1"].worker
    p.drains.start(DrainRequest(victim, "operator", "test", 0.0, 0.0))
    assert p.drains.step().lost == {} and p.progress.grants.holds == {victim: 2}  # held at the grant
    for s in (0, 1):
        for node in ("fwd0", "fwd1"):
            p.progress.instance(pb.InstanceDone(node=node, step=s))
    p.progress.complete()
    p.progress.commit("s1", 2)
    spare = next(w for w in ("w0", "w1", "w2") if w not in {q.worker for q in p.places.slices.values()})
    p.workers.load_failures = [{spare: call_failed(spare, grpc.StatusCode.UNAVAILABLE, "Connection refused")}]
    lost = p.drains.step().lost
    assert list(lost) == [spare] and p.drains.drains == {}
    assert p.drains.drain_records[0].state == "aborted"


def test_a_drain_that_moves_returns_the_spares_log_floor_and_leaves_the_progress_to_the_executor() -> None:
    p = Parts()
    loaded(p)
    victim = p.places.slices["s1"].worker
    p.drains.start(DrainRequest(victim, "operator", "test", 0.0, 0.0))
    assert p.drains.step() == DrainsStep({}, ()) and p.progress.grants.holds == {victim: 2}
    for s in (0, 1):
        for node in ("fwd0", "fwd1"):
            p.progress.instance(pb.InstanceDone(node=node, step=s))
    p.progress.complete()
    p.progress.commit("s1", 2)
    moved = p.drains.step()
    assert moved == DrainsStep({}, (LogFloor(("fwd1",), 2),)) and p.places.slices["s1"].worker != victim
    assert p.progress.log_floor == {} and p.progress.grants.holds == {}  # the floor is the executor's to move
    assert p.drains.step() == DrainsStep({}, ())  # handed out once


def test_a_drain_of_a_job_without_checkpoints_is_cancelled_and_changes_nothing() -> None:
    p = Parts()
    loaded(p)
    p.drains.open_run(checkpoints=False)
    before = (dict(p.places.slices), p.leases())
    victim = p.places.slices["s1"].worker
    p.drains.start(DrainRequest(victim, "operator", "test", 0.0, 0.0))
    assert p.drains.step().lost == {} and p.drains.drains == {}
    assert p.drains.drain_records[0].state == "cancelled" and "keeps no checkpoints" in p.drains.drain_records[0].detail
    assert (dict(p.places.slices), p.leases()) == before and p.progress.grants.holds == {}


# -- the ports ------------------------------------------------------------------------------------------------


def test_the_recovery_port_returns_the_restore_point_ignoring_commits_past_the_bad_cut_and_moves_no_cut() -> None:
    p = Parts()
    for s in ("s0", "s1"):
        for step in (5, 10):
            p.store.put(p.keys.checkpoint("pipe", s, step), json.dumps(CheckpointCommit("pipe", s, step, "/", "x")
                                                                      .to_json()))
            p.progress.commit(s, step)
    assert p.progress.cut == 10
    restored: list[Any] = []
    port = JobRecoveryPort(p.graph, term=p.term, placement=p.places, loads=p.loads, progress=p.progress,
                           on_restored=restored.append, job_cut=JobCut(p.term, p.progress))

    class Rec:  # what the port reads of a Recovery
        record = record(checkpoint_step=5)
        data = type("D", (), {"bad_cut": 10})()

    port.restored(Rec())  # type: ignore[arg-type]
    assert restored and p.progress.cut == 10  # the port tells the executor; it moves no cut itself
    cut, commits = port.restore_point(Rec())  # type: ignore[arg-type]
    assert (cut, commits) == (5, {"s0": [5], "s1": [5]}) and p.progress.cut == 10
    port.drop_commit("s1", 10, "did not restore")  # carried out by the executor's JobCut: etcd and the progress
    assert port.corrupt == [{"slice": "s1", "step": 10, "error": "did not restore"}]
    assert p.store.get(p.keys.checkpoint("pipe", "s1", 10)) is None and not p.progress.saved("s1", 10)
    p.progress.restored(cut, commits)  # what the executor's JobCut does with the restore point
    assert p.progress.cut == 5
    assert p.progress.commit("s0", 10) is None  # s0's commit at 10 is past the bad cut: it counts once heard anew
    assert p.progress.commit("s1", 10) == 10


def test_the_recovery_ports_restart_of_every_runtime_is_handed_to_the_cut_mover_which_lowers_the_log_floor() -> None:
    p = Parts()
    p.places.place(lambda: read_cluster(p.store, p.keys))
    assert p.loads.load(None, 0, {}) == {}
    p.progress.floor(["fwd1"], 12)  # a drain's spares log from 12
    reset: list[bool] = []

    class Cut(JobCut):
        def reset_logs(self) -> None:
            reset.append(True)
            super().reset_logs()

    port = JobRecoveryPort(p.graph, term=p.term, placement=p.places, loads=p.loads, progress=p.progress,
                           on_restored=lambda r: None, job_cut=Cut(p.term, p.progress))
    port.reset_all()
    assert reset == [True] and p.loads.loaded == [] and p.progress.log_floor == {}


def test_the_cut_mover_carries_out_a_nonfinite_stop_and_says_when_etcd_kept_the_commits() -> None:
    from rallypoint.orchestrator.job.metrics import JobMetrics, NonFinite
    p = Parts()
    for s in ("s0", "s1"):
        for step in (4, 6, 8):
            p.store.put(p.keys.checkpoint("pipe", s, step), json.dumps(CheckpointCommit("pipe", s, step, "/", "x")
                                                                      .to_json()))
            p.progress.commit(s, step)
    metrics = JobMetrics(p.spec, log=p.log, event=p.event)
    reason = JobCut(p.term, p.progress).stop(NonFinite("loss", float("nan"), 7, "fwd1", 0), metrics)
    assert reason.endswith("the last committed cut, step 6, is kept: fix the cause and resume from it"), reason
    assert p.progress.cut == 6 and sorted(c.step for c in p.term.commits()["s0"]) == [4, 6]
    p.election.depose()  # the term is over: nothing is dropped, and the reason says so
    reason = JobCut(p.term, p.progress).stop(NonFinite("loss", float("nan"), 5, "fwd1", 0), metrics)
    assert "could not be dropped" in reason and "rallypoint status pipe" in reason and p.progress.cut == 6


def test_the_cut_mover_drops_a_commit_everywhere_sets_the_floors_and_the_restored_cut() -> None:
    p = Parts()
    for s in ("s0", "s1"):
        p.store.put(p.keys.checkpoint("pipe", s, 5), json.dumps(CheckpointCommit("pipe", s, 5, "/", "x").to_json()))
        p.progress.commit(s, 5)
    cut = JobCut(p.term, p.progress)
    cut.floors([LogFloor(("fwd1",), 8), LogFloor(("fwd0",), 9)])
    assert p.progress.cut == 5 and p.progress.log_floor == {"fwd1": 8, "fwd0": 9}
    cut.drop_commit("s0", 5)
    assert p.store.get(p.keys.checkpoint("pipe", "s0", 5)) is None and not p.progress.saved("s0", 5)
    cut.restored(0, {"s1": [5]})
    assert p.progress.cut == 0 and p.progress.log_floor == {"fwd1": 8, "fwd0": 9}
    cut.reset_logs()
    assert p.progress.log_floor == {}


def test_the_straggler_port_cordons_as_the_watch_and_takes_its_cordon_back() -> None:
    p = Parts()
    port = JobStragglerPort("pipe", term=p.term, placement=p.places, loads=p.loads, progress=p.progress,
                            drains=p.drains, busy=lambda: "", event=p.event)
    assert port.cordon("w1", "s1", Probation(None, (1.0,), "kept out")) == ""
    kv = p.store.get(p.keys.cordon("w1"))
    assert json.loads(kv.value)["by"] == "straggler" and kv.lease == 0 and json.loads(kv.value)["kept_out"]
    port.uncordon("w1")
    assert p.store.get(p.keys.cordon("w1")) is None
    assert port.cordon("w1", "s1", Probation(30.0, (1.0,), "on probation")) == ""
    kv = p.store.get(p.keys.cordon("w1"))
    assert kv.lease and p.store.lease_ttl(kv.lease) == 30 and "lapses_at" in json.loads(kv.value)
    p.store.revoke_lease(kv.lease)  # the probation ends: etcd deletes the cordon with its lease
    assert p.store.get(p.keys.cordon("w1")) is None
    assert port.straggler_moves("w1") == []
    port.note_moves("w1", (1.0, 2.0))
    assert port.straggler_moves("w1") == [1.0, 2.0]
    p.election.depose()
    assert port.cordon("w1", "s1", Probation(None, (1.0,), "kept out")) != ""
    assert p.store.get(p.keys.cordon("w1")) is None  # a term that is over writes nothing


def test_a_straggler_cordon_lapses_in_a_real_etcd_and_a_second_move_keeps_the_worker_out(store: Any) -> None:
    keys, clock = Keys("t"), FakeClock()
    election = FakeElection(store, keys, clock)
    term = JobTerm("pipe", store=store, keys=keys, election=election, clock=clock, log=FakeLog())
    port = JobStragglerPort("pipe", term=term, placement=None, loads=None, progress=None,  # type: ignore[arg-type]
                            drains=None, busy=lambda: "", event=lambda *a, **k: None)
    settings = StragglerSettings(probation_s=1.0, repeat_window_s=600.0)
    first = probation(port.straggler_moves("w1"), clock.wall(), settings)
    assert first.lapse_s == 1.0 and port.cordon("w1", "s1", first) == ""
    assert store.get(keys.cordon("w1")) is not None
    deadline = time.monotonic() + 15
    while store.get(keys.cordon("w1")) is not None:  # etcd itself ends the probation
        assert time.monotonic() < deadline, "the straggler cordon never lapsed"
        time.sleep(0.1)
    port.note_moves("w1", first.moves)
    store.keepalive(election.lease)
    second = probation(port.straggler_moves("w1"), clock.wall(), settings)
    assert second.lapse_s is None and port.cordon("w1", "s1", second) == ""
    kv = store.get(keys.cordon("w1"))
    assert kv is not None and kv.lease == 0 and "uncordon" in kv.json()["kept_out"]


# -- JobLoads and JobRecoveries -------------------------------------------------------------------------------


def test_loads_start_each_slice_from_the_cut_and_name_the_newer_commits() -> None:
    p = Parts()
    p.places.place(lambda: read_cluster(p.store, p.keys))
    commits = {s: [CheckpointCommit("pipe", s, step, f"/ck/{s}/{step}", "x") for step in (5, 10, 15)]
               for s in ("s0", "s1")}
    reqs = p.loads.requests(None, 10, commits)
    assert sorted(reqs) == sorted({q.worker for q in p.places.slices.values()})
    for req in reqs.values():
        assert req.start_step == 10 and [r.step for r in req.restore] == [10] and [r.step for r in req.committed] == [15]
    one = p.places.slices["s1"].worker
    assert list(p.loads.requests({one}, 10, commits)) == [one]
    assert p.loads.load({one}, 10, commits) == {} and p.loads.loaded == [one] and one in p.loads.last_heard
    p.loads.reset_all()
    assert p.loads.loaded == [] and one in p.workers.unloaded


def test_a_stall_is_a_setback_decided_like_any_other_and_its_budget_runs_out() -> None:
    from rallypoint.orchestrator.job.recoveries import JobRecoveries
    from rallypoint.orchestrator.job.watchdog import ProgressWatchdog
    from rallypoint.recovery.decide import Budget, Fail, Refence
    p = Parts()
    port = JobRecoveryPort(p.graph, term=p.term, placement=p.places, loads=p.loads, progress=p.progress,
                           on_restored=lambda r: None, job_cut=JobCut(p.term, p.progress))
    rec = JobRecoveries(port, budget=Budget(stall=1), clock=p.clock, log=p.log, microbatches=1)
    dog = ProgressWatchdog(p.clock, 30)
    p.clock.advance(31)
    assert dog.check() is not None
    reason, decision = rec.stalled(31.0, dog, {"w1": "node 'fwd1' made no progress past step 4"}, 4)
    assert isinstance(decision, Refence) and "no progress for 31.0s" in reason and "w1: node 'fwd1'" in reason
    p.clock.advance(31)
    assert dog.check() is not None
    _reason, decision = rec.stalled(31.0, dog, {"w1": "again"}, 4)
    assert isinstance(decision, Fail)
    assert rec.active is None and rec.to_json() == []


def test_the_recovery_port_decides_on_a_failed_load_instead_of_raising() -> None:
    """A load that failed for another reason than a lost worker is a Fail the executor carries out (the job
    fails); a port that raised JobFailed itself, or returned workers to recover, would fail here."""
    p = Parts()
    p.places.place(lambda: read_cluster(p.store, p.keys))
    port = JobRecoveryPort(p.graph, term=p.term, placement=p.places, loads=p.loads, progress=p.progress,
                           on_restored=lambda _r: None, job_cut=JobCut(p.term, p.progress))
    w = p.places.slices["s0"].worker
    assert port.lost_at_load(Budget(), {}, 0) == {}
    refused = WorkerCallFailed(w, "LoadJob", grpc.StatusCode.INVALID_ARGUMENT, "the program does not deserialize")
    decision = port.lost_at_load(Budget(), {w: refused}, 0)
    assert isinstance(decision, Fail) and "deserialize" in decision.reason
