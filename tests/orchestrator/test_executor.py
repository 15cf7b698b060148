"""The job executor one step at a time: a MemoryStore, a FakeElection, FakeWorkers and a FakeClock.

These check the executor's own logic (states and their transitions, what it records
and releases, losses, stalls, term fencing, adoption); tests/integration/ runs the same
paths against real etcd and real worker processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.orchestrator.job.executor import JOBSPEC_FILE, run_dir
from rallypoint.orchestrator.job.state import HandedOff, JobFailed, JobState
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto.errors import corrupt_checkpoint_metadata
from tests.fakes import call_failed, register_worker
from tests.helpers.executor import Harness, join_while_waiting, pipeline_spec, recovered

def test_begin_places_loads_and_grants_then_steps_complete_the_job(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    assert h.x.state is JobState.RUNNING and len(h.leases()) == 2
    assert h.record()["state"] == "running" and h.record()["term"] == h.election.term
    assert sorted(w for w, _ in h.workers.loads) == sorted({h.worker_of("s0"), h.worker_of("s1")})
    h.x.step(timeout_s=0.0)
    assert h.x.progress.completed == 0  # one event a step: fwd0 of step 0
    h.steps_until(1)
    assert h.x.progress.granted == 3  # step 0 is done: the window of two steps moves on
    h.steps_until(20)
    end = h.x.finish()
    assert end.event == "job.finished" and json.loads(end.detail)["recoveries"] == []
    assert h.x.state is JobState.FINISHING


def test_run_drives_begin_step_finish_and_ends_with_one_terminal_event(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    assert h.x.run() is JobState.SUCCEEDED
    assert h.names() == ["job.placed", "job.started", "job.finished"]
    assert [e.step for e in h.events if e.event == "step.done"] == list(range(20))
    assert h.record()["state"] == "succeeded" and h.leases() == []
    assert sorted(h.workers.unloaded) == sorted({h.worker_of("s0"), h.worker_of("s1")})
    assert (run_dir(tmp_path, "pipe", create=False) / JOBSPEC_FILE).exists()


def test_a_lost_worker_moves_its_slice_to_the_spare_and_replays_only_it(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    h.steps_until(12)
    victim, survivor = h.worker_of("s1"), h.worker_of("s0")
    h.store.revoke_lease(h.store.get(h.keys.worker(victim)).lease)  # the process died: its lease goes with it
    h.workers.end(victim)
    h.steps_until(20)
    rec = h.x.recovery.records[0]
    assert rec.escalated == ""
    assert rec.lost == {victim: ["s1"]} and rec.policy == "partial" and rec.checkpoint_step == 10
    assert rec.replay_nodes == ["fwd1"]
    spare = h.worker_of("s1")
    assert spare not in (victim, survivor) and (spare, 10) in h.workers.loads
    assert h.workers.rewires == [(survivor, 10)]
    assert h.x.recovery.machines[0].phase.value in ("replaying", "catching_up", "done")
    assert "job.recovering" in h.names() and "job.recovered" in h.names()
    assert h.x.port.failures[0]["worker"] == victim


def test_a_hung_worker_is_recovered_once_its_registration_is_gone(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    h.steps_until(6)
    victim = h.worker_of("s0")
    h.workers.silent.add(victim)
    for _ in range(20):
        h.x.step(timeout_s=0.0)
    assert h.x.recovery.records == []  # still registered: nothing is declared lost
    h.store.revoke_lease(h.store.get(h.keys.worker(victim)).lease)  # its lease expired
    h.clock.advance(1.5)
    h.x.step(timeout_s=0.0)
    assert h.x.recovery.records and h.x.recovery.records[0].lost == {victim: ["s0"]}
    assert "registration is gone" in h.x.recovery.records[0].reasons[victim]
    h.steps_until(20)


def test_no_progress_for_the_stall_timeout_is_a_stalled_event_and_a_recovery(tmp_path: Path) -> None:
    h = Harness(tmp_path, spec=pipeline_spec(stall_timeout_s=30))
    h.x.begin()
    h.steps_until(6)
    victim = h.worker_of("s0")
    h.workers.silent.add(victim)  # hung, but its lease is renewed (a hung thread, not a hung process)
    for _ in range(10):
        h.x.step(timeout_s=0.0)
    h.clock.advance(31)
    h.x.step(timeout_s=0.0)
    stalled = [e for e in h.events if e.event == "job.stalled"]
    assert len(stalled) == 1
    detail = json.loads(stalled[0].detail)
    assert detail["workers"] == [victim] and "no progress for 31" in detail["reason"]
    assert h.store.get(h.keys.worker(victim)) is None  # fenced
    assert h.x.recovery.records[0].lost == {victim: ["s0"]}
    h.steps_until(20)


def test_a_deposed_executor_hands_off_and_writes_nothing_more(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    h.steps_until(5)
    before = h.record()
    h.election.depose()
    with pytest.raises(HandedOff):
        h.x.step(timeout_s=0.0)
    assert h.record() == before
    h2 = Harness(tmp_path)
    h2.x.begin()
    h2.steps_until(3)
    h2.election.depose()
    assert h2.x.run() is JobState.HANDED_OFF
    assert h2.names()[-1] == "job.handed_off" and h2.record()["state"] == "running"
    assert h2.leases() != []  # the next leader releases them, not a term that is over


def test_stop_ends_the_run_with_job_handed_off(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    h.steps_until(3)
    h.x.stop("the coordinator stepped down")
    with pytest.raises(HandedOff, match="stepped down"):
        h.x.step(timeout_s=0.0)


def test_transitions_outside_the_table_are_refused(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    with pytest.raises(AssertionError, match="no transition running -> succeeded"):
        h.x._set_state(JobState.SUCCEEDED)


def test_a_failed_run_records_the_reason_and_releases_leases(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    orig = h.workers.grant

    def grant_then_fail(grants: Any) -> None:
        orig(grants)
        w = h.worker_of("s1")
        h.workers.events.put(("done", (w, h.workers.generation[w], pb.InstanceDone(node="fwd1", step=1,
                                                                                   error="NaN in the loss"))))
    h.workers.grant = grant_then_fail  # type: ignore[method-assign]
    assert h.x.run() is JobState.FAILED
    assert h.record()["state"] == "failed" and "NaN in the loss" in h.record()["reason"]
    assert h.leases() == [] and h.names()[-1] == "job.failed"


def test_an_adopted_job_restarts_from_the_newest_cut_that_restores(tmp_path: Path) -> None:
    first = Harness(tmp_path)
    first.x.begin()
    first.steps_until(12)
    commits = {s: [CheckpointCommit("pipe", s, step, f"/ck/{s}/{step}", "x") for step in (5, 10)] for s in ("s0", "s1")}
    for s, cs in commits.items():
        for c in cs:
            first.store.put(first.keys.checkpoint("pipe", s, c.step), json.dumps(c.to_json()))
    first.election.depose()  # the first leader is gone; its device leases are still there
    assert first.leases() != []
    h = Harness(tmp_path, adopted=True, store=first.store)
    h.workers.load_failures = [{h_w: call_failed(h_w, grpc.StatusCode.DATA_LOSS, "corrupt",
                                                  corrupt_checkpoint_metadata("s1", 10))
                                for h_w in ("w0", "w1", "w2")}]
    assert h.x.run() is JobState.SUCCEEDED
    adopted = [e for e in h.events if e.event == "job.adopted"]
    assert len(adopted) == 1 and adopted[0].step == 5  # the cut at 10 did not restore: its commit is dropped
    assert [(c["slice"], c["step"]) for c in h.x.port.corrupt] == [("s1", 10)]
    assert {s for _w, s in h.workers.loads} == {5}
    assert [e.step for e in h.events if e.event == "step.done"] == list(range(5, 20))
    assert h.record()["state"] == "succeeded" and h.record()["term"] == h.election.term


def test_an_adopting_leader_carries_the_recoveries_on_and_finishes_the_one_it_adopted_open(tmp_path: Path) -> None:
    first = Harness(tmp_path, workers=5)
    first.x.begin()
    first.steps_until(12)
    victim = first.worker_of("s1")
    first.store.revoke_lease(first.store.get(first.keys.worker(victim)).lease)
    first.workers.end(victim)
    recovered(first, 1)  # restored and running again; its replay is not measured yet when the term ends
    (open_rec,) = first.record()["recoveries"]
    assert open_rec["mttr_s"] is None and "replay" not in open_rec["phases"]
    first.election.depose()
    h = Harness(tmp_path, adopted=True, store=first.store)
    h.x.begin()
    h.steps_until(15)
    lost = h.worker_of("s0")
    h.store.revoke_lease(h.store.get(h.keys.worker(lost)).lease)
    h.workers.end(lost)
    recovered(h, 1)
    h.steps_until(20)
    finished = h.x.finish()
    recs = json.loads(finished.detail)["recoveries"]
    assert [r["recovery"] for r in recs] == [1, 2]  # the adopted one, then this term's, numbered after it
    adopted, own = recs
    assert adopted["detected_at"] == open_rec["detected_at"] and adopted["lost"] == {victim: ["s1"]}
    assert adopted["adopted_by_term"] == h.election.term and adopted["finished_by"] == "adoption"
    assert adopted["mttr_s"] is not None and adopted["mttr_s"] >= 0 and adopted["phases"] == open_rec["phases"]
    assert own["lost"] == {lost: ["s0"]} and "adopted_by_term" not in own
    assert [r["recovery"] for r in h.record()["recoveries"]] == [1, 2]  # the job record keeps them too

def adopt_after_losing_two_of_three(tmp_path: Path, **spec: Any) -> Harness:
    """A leader ran the job to step 12 (cut 10) and is gone, with two of the three workers: one is left."""
    first = Harness(tmp_path, spec=pipeline_spec(**spec))
    first.x.begin()
    first.steps_until(12)
    for s in ("s0", "s1"):
        c = CheckpointCommit("pipe", s, 10, f"/ck/{s}/10", "x")
        first.store.put(first.keys.checkpoint("pipe", s, 10), json.dumps(c.to_json()))
    first.election.depose()
    for w in ("w1", "w2"):
        first.store.revoke_lease(first.store.get(first.keys.worker(w)).lease)
    return Harness(tmp_path, adopted=True, store=first.store, spec=pipeline_spec(**spec))


def test_an_adopted_slice_without_room_waits_for_a_worker_as_on_no_spare_wait_says(tmp_path: Path) -> None:
    h = adopt_after_losing_two_of_three(tmp_path, wait_timeout_s=30)
    joined = join_while_waiting(h)  # 5 s into the wait, a worker registers
    assert h.x.run() is JobState.SUCCEEDED, h.record().get("reason")
    assert joined and {h.worker_of("s0"), h.worker_of("s1")} == {"w0", "w9"}
    waiting = [json.loads(e.detail) for e in h.events if e.event == "job.waiting"]
    assert len(waiting) == 1 and waiting[0]["timeout_s"] == 30 and list(waiting[0]["missing"]) in (["s0"], ["s1"])
    assert h.names().index("job.waiting") < h.names().index("job.adopted")


def test_an_adopted_slice_without_room_fails_after_wait_timeout_or_at_once_with_on_no_spare_fail(
        tmp_path: Path) -> None:
    h = adopt_after_losing_two_of_three(tmp_path / "a", wait_timeout_s=30)
    start = h.clock.monotonic()
    assert h.x.run() is JobState.FAILED
    assert "waited 30 s of wait_timeout_s=30" in h.record()["reason"] and h.clock.monotonic() - start >= 30
    assert h.leases() == []
    h = adopt_after_losing_two_of_three(tmp_path / "b", on_no_spare="fail")
    start = h.clock.monotonic()
    assert h.x.run() is JobState.FAILED
    assert "on_no_spare='fail'" in h.record()["reason"] and h.clock.monotonic() - start < 1


def test_an_adopting_load_refused_by_the_old_leaders_runtime_unloads_it_and_asks_again(tmp_path: Path) -> None:
    # The lost leader's load was still on its way to w1 when the stale runtimes were unloaded: w1 refuses twice.
    h = adopt_after_losing_two_of_three(tmp_path)
    register_worker(h.store, h.keys, "w1", 1)
    busy = call_failed("w1", grpc.StatusCode.FAILED_PRECONDITION, "job 'pipe' is already loaded on worker w1")
    h.workers.load_failures = [{"w1": busy}, {"w1": busy}]
    start = h.clock.monotonic()
    assert h.x.run() is JobState.SUCCEEDED, h.record().get("reason")
    assert h.workers.unloaded.count("w1") >= 3 and h.clock.monotonic() - start >= 2  # once, then before each retry
    assert sorted(w for w, _ in h.workers.loads) == ["w0", "w1"] and h.workers.load_failures == []


def test_a_worker_lost_while_the_job_loads_is_recovered_not_fatal(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x._prepare()
    h.x._place()
    victim = h.worker_of("s1")
    h.store.revoke_lease(h.store.get(h.keys.worker(victim)).lease)  # killed 0.06 s into the job
    h.workers.load_failures = [{victim: call_failed(victim, grpc.StatusCode.UNAVAILABLE, "Connection refused")}]
    h.x._prepare = lambda: None  # type: ignore[method-assign]  # already done, placement kept
    h.x._place = lambda: {}  # type: ignore[method-assign]
    assert h.x.run() is JobState.SUCCEEDED
    assert h.x.recovery.records[0].lost == {victim: ["s1"]} and h.worker_of("s1") != victim
    assert "job.recovered" in h.names()


def test_a_load_refused_for_a_reason_other_than_a_loss_fails_the_job_clearly(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.workers.load_failures = [{w: call_failed(w, grpc.StatusCode.INVALID_ARGUMENT, "slice s1 needs 4 devices")
                                for w in ("w0", "w1", "w2")}]
    assert h.x.run() is JobState.FAILED
    assert "could not load the job" in h.record()["reason"] and "needs 4 devices" in h.record()["reason"]
    assert h.leases() == []


def test_the_programs_own_failure_at_load_fails_the_job_at_once_naming_it_and_fences_nobody(tmp_path: Path) -> None:
    from rallypoint.proto.errors import program_failed_metadata

    h = Harness(tmp_path)
    meta = program_failed_metadata("state 'p1' init", "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory")
    h.workers.load_failures = [{w: call_failed(w, grpc.StatusCode.INTERNAL, f"loading job 'pipe': state 'p1' init "
                                               f"failed on worker {w}: RESOURCE_EXHAUSTED", meta)
                                for w in ("w1",)}]
    assert h.x.run() is JobState.FAILED
    reason = h.record()["reason"]
    assert "state 'p1' init failed on worker w1: RESOURCE_EXHAUSTED" in reason and "none was fenced" in reason
    assert h.x.port.failures == [] and h.x.recovery.records == [] and "job.recovering" not in h.names()
    assert all(h.store.get(h.keys.worker(w)) is not None for w in ("w0", "w1", "w2"))  # every worker still live
    assert h.leases() == []


def test_a_node_that_fails_at_its_first_call_fails_the_job_naming_node_worker_and_error_and_fences_nobody(
        tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    w = h.worker_of("s1")
    error = "XlaRuntimeError: INVALID_ARGUMENT: the program does not compile for this mesh"
    h.workers.events.put(("done", (w, h.workers.generation[w], pb.InstanceDone(node="fwd1", step=0, error=error))))
    with pytest.raises(JobFailed) as info:
        for _ in range(50):
            h.x.step(timeout_s=0.0)
    assert str(info.value) == f"node 'fwd1' failed at step 0 on worker {w}: {error}"
    assert h.x.port.failures == [] and h.x.recovery.records == []
    assert all(h.store.get(h.keys.worker(x)) is not None for x in ("w0", "w1", "w2"))


def test_a_slice_whose_nodes_never_ran_compiles_and_is_not_stalled_before_the_compile_timeout(tmp_path: Path) -> None:
    h = Harness(tmp_path, spec=pipeline_spec(stall_timeout_s=30, compile_timeout_s=600))
    h.x._prepare()
    h.x._place()
    victim = h.worker_of("s0")
    h.workers.silent.add(victim)  # its first call compiles for minutes: nothing from it yet
    h.x._prepare = lambda: None  # type: ignore[method-assign]  # already done, placement kept
    h.x._place = lambda: {}  # type: ignore[method-assign]
    h.x.begin()
    for advance in (31, 31, 31, 31, 500):
        h.clock.advance(advance)
        h.x.step(timeout_s=0.0)
        assert [e for e in h.events if e.event == "job.stalled"] == [], advance
    h.clock.advance(100)  # 624 s without progress, all of it compiling: past compile_timeout_s
    h.x.step(timeout_s=0.0)
    stalled = [json.loads(e.detail) for e in h.events if e.event == "job.stalled"]
    assert len(stalled) == 1 and stalled[0]["workers"] == [victim]


def test_the_failure_policy_fails_the_job_on_one_fault_too_many_in_its_window_listing_them(tmp_path: Path) -> None:
    h = Harness(tmp_path, workers=5, spec=pipeline_spec(max_faults=1, failure_window_s=600))
    h.x.begin()
    h.steps_until(6)
    first = h.worker_of("s1")
    h.store.revoke_lease(h.store.get(h.keys.worker(first)).lease)
    h.workers.end(first)
    h.steps_until(12)
    assert len(h.x.recovery.records) == 1
    second = h.worker_of("s0")
    h.store.revoke_lease(h.store.get(h.keys.worker(second)).lease)
    h.workers.end(second)
    with pytest.raises(JobFailed) as info:
        for _ in range(50):
            h.x.step(timeout_s=0.0)
    reason = str(info.value)
    assert "failed 2 times from faults in the last 600s, more than its max_faults=1" in reason
    assert f"recovery 1 (0s ago): {first}: " in reason and f"recovery 2 (0s ago): {second}: " in reason
    assert len(h.x.recovery.records) == 1  # the second was never started: nothing more fenced or moved


def test_a_negative_failure_policy_setting_fails_the_job_naming_the_field(tmp_path: Path) -> None:
    h = Harness(tmp_path, spec=pipeline_spec(max_faults=-1))
    assert h.x.run() is JobState.FAILED
    assert "max_faults must be >= 0" in h.record()["reason"]


def test_a_pause_of_the_term_is_not_counted_as_a_stall(tmp_path: Path) -> None:
    h = Harness(tmp_path, spec=pipeline_spec(stall_timeout_s=30))
    h.x.begin()
    h.steps_until(4)
    # The lease's local deadline passed: the coordinator stepped down keeping its lease, so the term may come back.
    h.election.term, term = None, h.election.term
    paused = {"n": 0}

    def sleep(s: float) -> None:  # etcd comes back after 40 s of the clock
        paused["n"] += 1
        h.clock.advance(s)
        if h.clock.monotonic() - start >= 40:
            h.election.term = term

    start = h.clock.monotonic()
    h.clock.sleep = sleep  # type: ignore[method-assign]
    h.x.step(timeout_s=0.0)
    assert paused["n"] > 0 and h.election.term == term
    h.steps_until(20)
    assert [e for e in h.events if e.event == "job.stalled"] == []


def lose_with_a_corrupt_cut(h: Harness) -> None:
    """s1's worker dies at step 12; every spare finds s1's checkpoint at step 10 corrupt when it restores it."""
    h.x.begin()
    h.steps_until(12)
    assert h.x.progress.cut == 10
    victim, survivor = h.worker_of("s1"), h.worker_of("s0")
    spares = [w for w in ("w0", "w1", "w2", "w3") if w not in (victim, survivor)]
    h.workers.load_failures = [{w: call_failed(w, grpc.StatusCode.DATA_LOSS, "corrupt",
                                               corrupt_checkpoint_metadata("s1", 10)) for w in spares}]
    h.store.revoke_lease(h.store.get(h.keys.worker(victim)).lease)
    h.workers.end(victim)


def test_a_fall_back_past_a_corrupt_commit_lowers_the_cut_the_workers_are_told(tmp_path: Path) -> None:
    """The cut goes down with the restore: after falling back from a corrupt commit at step 10 to the cut at 5, no
    grant tells the workers 10 (they would protect the bad step and release the good one) until 10 is saved anew."""
    h = Harness(tmp_path, workers=4)
    lose_with_a_corrupt_cut(h)
    recovered(h, 1)
    first = h.x.recovery.records[0]
    assert first.checkpoint_step == 5 and first.policy == "restart-all"
    assert [(c["slice"], c["step"]) for c in h.x.port.corrupt] == [("s1", 10)]
    h.steps_until(20)
    restarted = set(first.generations.items())  # the runtimes loaded from step 5
    told = [c for w, g, c in h.workers.cuts if (w, g) in restarted]
    resaved = next(i for i, c in enumerate(told) if c != 5)
    assert resaved > 0 and told[resaved] == 10 and all(c >= 10 for c in told[resaved:]), told


def test_a_second_loss_after_a_fall_back_restores_from_the_lowered_cut(tmp_path: Path) -> None:
    h = Harness(tmp_path, workers=4)
    lose_with_a_corrupt_cut(h)
    h.workers.silent.update(("w0", "w1", "w2", "w3"))  # nothing runs past the restore until the second loss
    recovered(h, 1)
    assert h.x.progress.cut == 5
    second = h.worker_of("s0")
    h.workers.silent.clear()
    h.store.revoke_lease(h.store.get(h.keys.worker(second)).lease)
    h.workers.end(second)
    recovered(h, 2)
    assert h.x.recovery.records[1].checkpoint_step == 5 and h.x.progress.cut == 5
    h.steps_until(20)
    assert [(c["slice"], c["step"]) for c in h.x.port.corrupt] == [("s1", 10)]
    assert h.x.progress.cut == 15


def _as_batches(h: Harness) -> None:
    """What the fakes put on the queue one event at a time, regrouped as the streams send it: a batch per worker."""
    by_worker: dict[tuple[str, int], list[pb.InstanceDone]] = {}
    while not h.workers.events.empty():
        kind, (w, gen, item) = h.workers.events.get_nowait()
        assert kind == "done"
        by_worker.setdefault((w, gen), []).append(item)
    for (w, gen), items in by_worker.items():
        h.workers.events.put(("batch", (w, gen, items)))


def test_a_batch_of_instances_is_handled_in_one_pass_and_the_window_moves_once(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    _as_batches(h)  # steps 0 and 1 (the window) of both stages, one message per worker
    h.x.step(timeout_s=0.0)
    h.x.step(timeout_s=0.0)
    assert h.x.progress.completed == 2 and h.x.progress.granted == 4
    stale = h.worker_of("s0")
    h.workers.events.put(("batch", (stale, h.workers.generation[stale] - 1, [pb.InstanceDone(node="fwd0", step=9)])))
    h.x.step(timeout_s=0.0)  # a runtime given up on: its batch is dropped whole
    assert h.x.progress.done_through("fwd0") < 9
    h.steps_until(20)
    assert h.x.finish().event == "job.finished"


def test_an_error_in_a_batch_fails_the_job_after_the_instances_before_it(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    while not h.workers.events.empty():
        h.workers.events.get_nowait()
    w = h.worker_of("s0")
    h.workers.events.put(("batch", (w, h.workers.generation[w], [
        pb.InstanceDone(node="fwd0", step=0), pb.InstanceDone(node="fwd0", step=1, error="boom")])))
    with pytest.raises(JobFailed, match=f"node 'fwd0' failed at step 1 on worker {w}: boom"):
        h.x.step(timeout_s=0.0)
    assert h.x.progress.done_through("fwd0") == 1  # step 0 was counted first


def test_the_steps_before_a_non_finite_metric_in_a_batch_are_done_before_the_job_stops(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    while not h.workers.events.empty():
        h.workers.events.get_nowait()
    gens = {s: (h.worker_of(s), h.workers.generation[h.worker_of(s)]) for s in ("s0", "s1")}
    h.workers.events.put(("batch", (*gens["s0"], [pb.InstanceDone(node="fwd0", step=0),
                                                  pb.InstanceDone(node="fwd0", step=1)])))
    h.x.step(timeout_s=0.0)
    h.workers.events.put(("batch", (*gens["s1"], [
        pb.InstanceDone(node="fwd1", step=0, metrics={"loss": 1.0}),
        pb.InstanceDone(node="fwd1", step=1, metrics={"loss": float("nan")})])))
    with pytest.raises(JobFailed):
        h.x.step(timeout_s=0.0)
    assert [e.step for e in h.events if e.event == "step.done"] == [0]  # step 0 is done, as one event at a time
