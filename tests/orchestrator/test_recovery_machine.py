"""The recovery state machine, one step at a time, against a fake job (a RecoveryPort subclass) and a fake clock.

Each test scripts what the cluster does (which loads and rewires fail and how, what
commits etcd holds at each read) and checks the states the recovery walks through,
what it did to the job, and the record it leaves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
import pytest

from rallypoint.basics.clock import FakeClock
from rallypoint.etcd.commits import CheckpointCommit, consistent_cut
from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from rallypoint.orchestrator.job.recovery import RecoveryRecord
from rallypoint.orchestrator.job.state import JobFailed
from rallypoint.recovery.load_plan import SlicePlace
from rallypoint.orchestrator.job.recovery_machine import (TRANSITIONS, CatchingUp, Done, Recovery, RecoveryPhase,
                                                      RecoveryPort)
from rallypoint.proto.errors import corrupt_checkpoint_metadata
from rallypoint.recovery.decide import Budget, Verdict
from rallypoint.recovery.remap import NoRoom
from rallypoint.recovery.replay import Edge, Graph, Node, ReplayPlan, State

P = RecoveryPhase
C = grpc.StatusCode


def lost(worker: str) -> WorkerCallFailed:
    return WorkerCallFailed(worker, "LoadJob", C.UNAVAILABLE, "failed to connect to all addresses; Connection refused")


def refused(worker: str) -> WorkerCallFailed:
    return WorkerCallFailed(worker, "LoadJob", C.FAILED_PRECONDITION, "storage refused")


def corrupt(worker: str, slice_name: str, step: int) -> WorkerCallFailed:
    return WorkerCallFailed(worker, "LoadJob", C.DATA_LOSS, f"corrupt checkpoint of {slice_name} at {step}",
                            corrupt_checkpoint_metadata(slice_name, step))


def commits_at(*steps: int) -> dict[str, list[CheckpointCommit]]:
    return {s: [CheckpointCommit("j", s, step, f"/ck/{s}/{step}", f"sum{step}") for step in steps] for s in ("s0", "s1")}


class FakeJob(RecoveryPort):
    """Two pipeline stages, s0 on w0 and s1 on w1, spares to take them; failures as scripted."""

    def __init__(self, *, spares: list[str], commits: list[dict[str, list[CheckpointCommit]]],
                 load_failures: list[dict[str, WorkerCallFailed]] | None = None,
                 rewire_failures: list[dict[str, WorkerCallFailed]] | None = None,
                 registered: Mapping[str, bool] | None = None, incarnations: Mapping[str, int] | None = None) -> None:
        self.graph = Graph(nodes=(Node("fwd0", "s0"), Node("fwd1", "s1")),
                           edges=(Edge("fwd0", "fwd1"), Edge("fwd0", "fwd0", "state", "p0"),
                                  Edge("fwd1", "fwd1", "state", "p1")),
                           states=(State("p0", "s0", "fwd0"), State("p1", "s1", "fwd1")))
        self.placement = {"s0": SlicePlace("w0", "w0:1", 100, (0,)), "s1": SlicePlace("w1", "w1:1", 101, (0,))}
        self.cut = 10
        self.progress = {"fwd0": 14, "fwd1": 13}
        self.loaded = {"w0", "w1"}
        self.spares = list(spares)
        self.incarnations = {w: 1000 for w in self.spares} | dict(incarnations or {})  # the registered incarnation
        self._commits = list(commits)
        self.load_failures = list(load_failures or [])
        self.rewire_failures = list(rewire_failures or [])
        self.registered_map = dict(registered or {})
        self.calls: list[tuple[Any, ...]] = []
        self.unanswered: set[str] = set()  # workers whose unload fails
        self.restored_with: list[Recovery] = []
        self.spare_wait_s = 0.0  # what each remap says it waited for a spare
        self.generations = {"w0": 1, "w1": 1, "w2": 7, "w3": 7}  # the job's runtimes now

    def loaded_workers(self) -> list[str]:
        return sorted(self.loaded)

    def fence(self, worker: str, incarnation: int) -> None:
        self.calls.append(("fence", worker, incarnation))

    def unload(self, worker: str) -> bool:
        self.calls.append(("unload", worker))
        if worker in self.unanswered:
            return False
        self.spares.append(worker)  # its devices let go: a spare like any other
        self.incarnations.setdefault(worker, self.placement[min(s for s, p in self.placement.items()
                                                                if p.worker == worker)].incarnation)
        return True

    def forget(self, worker: str) -> None:
        self.loaded.discard(worker)

    def record_failure(self, worker: str, incarnation: int, slices: list[str], reason: str) -> None:
        self.calls.append(("failure", worker, tuple(slices)))

    def commits(self) -> dict[str, list[CheckpointCommit]]:
        return self._commits.pop(0) if len(self._commits) > 1 else self._commits[0]

    def cut_step(self, commits: Mapping[str, list[CheckpointCommit]], before: int | None) -> int:
        return consistent_cut(commits, ["s0", "s1"], before=before) or 0

    def done_through(self, node: str) -> int:
        return self.progress[node]

    def devices_of(self, slice_name: str) -> int:
        return 1

    def remap(self, need: Mapping[str, int], exclude: frozenset[str], recovery: int, *,
              lost: Mapping[str, int] = {}) -> tuple[dict[str, SlicePlace], float]:
        placed = {}
        for s in sorted(need):
            free = [w for w in self.spares if w not in exclude and self.incarnations[w] > lost.get(w, -1)]
            if not free:
                return NoRoom(reason=f"no spare for {s}")  # the remap planner's decision
            self.spares.remove(free[0])
            placed[s] = SlicePlace(free[0], f"{free[0]}:1", self.incarnations[free[0]], (0,))
        self.calls.append(("remap", tuple(sorted(placed.items()))))
        return placed, self.spare_wait_s

    def place(self, places: Mapping[str, SlicePlace]) -> None:
        self.placement.update(places)

    def load(self, workers: set[str] | None, start: int, commits: Mapping[str, list[CheckpointCommit]], *,
             start_override: int | None = None) -> dict[str, WorkerCallFailed]:
        targets = sorted(workers) if workers is not None else sorted({p.worker for p in self.placement.values()})
        self.calls.append(("load", tuple(targets), start, start_override))
        failed = self.load_failures.pop(0) if self.load_failures else {}
        self.loaded.update(w for w in targets if w not in failed)
        return failed

    def rewire(self, worker: str, plan: ReplayPlan, cut: int, commits: Mapping[str, list[CheckpointCommit]]) -> None:
        self.calls.append(("rewire", worker, cut))
        if self.rewire_failures and worker in self.rewire_failures[0]:
            raise self.rewire_failures.pop(0)[worker]

    def reset_all(self) -> None:
        self.calls.append(("reset_all",))
        self.loaded.clear()

    def registered(self, worker: str) -> bool:
        return self.registered_map.get(worker, True)

    def drop_commit(self, slice_name: str, step: int, error: str) -> None:
        self.calls.append(("drop", slice_name, step))
        self._commits = [{s: [c for c in cs if c.step != step] for s, cs in commits.items()}
                         for commits in self._commits]

    def restored(self, recovery: Recovery) -> None:
        self.restored_with.append(recovery)


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _add(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    info = warning = error = _add

    def states(self) -> list[str]:
        return [kw["state"] for e, kw in self.events if e == "recovery.state"]


def recovery(job: FakeJob, lost_workers: Mapping[str, str], *, budget: Budget = Budget(), policy: str = "partial",
             hooks: ExecutorHooks = ExecutorHooks(), unload: frozenset[str] = frozenset()
             ) -> tuple[Recovery, Log, FakeClock]:
    clock, log = FakeClock(), Log()
    rec = RecoveryRecord(number=1, lost={}, reasons=dict(lost_workers), detected_at=0.0,
                         detected_mono=clock.monotonic(), detection_s=0.01)
    r = Recovery(job, rec, lost_workers, policy=policy, budget=budget, clock=clock, log=log,
                 frontier=dict(job.progress), microbatches=1, hooks=hooks, unload=unload)
    return r, log, clock


def test_one_loss_walks_every_state_in_order_and_moves_only_the_lost_slice() -> None:
    job = FakeJob(spares=["w2"], commits=[commits_at(5, 10)])
    r, log, _ = recovery(job, {"w1": "event stream ended"})
    assert r.phase is P.FENCING
    assert r.step().phase is P.PLANNING and ("fence", "w1", 101) in job.calls
    assert r.step().phase is P.REMAPPING
    assert r.step().phase is P.RESTORING and job.placement["s1"].worker == "w2"
    assert r.step().phase is P.REPLAYING
    assert log.states() == ["planning", "remapping", "restoring", "replaying"]
    assert ("load", ("w2",), 10, None) in job.calls and ("rewire", "w0", 10) in job.calls
    assert job.restored_with == [r]
    rec = r.record
    assert rec.policy == "partial" and rec.checkpoint_step == 10 and rec.moved == {"s1": "w2"}
    assert rec.replay_nodes == ["fwd1"] and rec.planned_instances == {"fwd1": 3}
    assert list(rec.marks) == ["fencing", "remap", "restore"]


def test_replay_then_catch_up_end_the_recovery() -> None:
    job = FakeJob(spares=["w2"], commits=[commits_at(10)])
    r, _, _ = recovery(job, {"w1": "gone"})
    r.run_to_replay()
    assert r.record.generations == {"w0": 1, "w1": 1, "w2": 7, "w3": 7}  # the recovery took them from its port
    for step in (10, 11):
        r.observe("w2", 7, "fwd1", step)
    assert r.phase is P.REPLAYING
    r.observe("w2", 6, "fwd1", 12)  # an older runtime of w2: not this recovery's replay
    assert r.phase is P.REPLAYING
    r.observe("w2", 7, "fwd1", 12)
    assert r.phase is P.CATCHING_UP and "replay" in r.record.marks
    job.progress = {"fwd0": 14, "fwd1": 12}
    r.progressed()
    assert r.phase is P.CATCHING_UP
    job.progress = {"fwd0": 15, "fwd1": 13}
    r.progressed()
    assert isinstance(r.state, Done) and r.record.done and r.record.to_json()["mttr_s"] is not None


def test_the_spare_lost_while_restoring_goes_back_to_fencing_and_takes_the_next_spare() -> None:
    job = FakeJob(spares=["w2", "w3"], commits=[commits_at(10)], load_failures=[{"w2": lost("w2")}])
    r, log, _ = recovery(job, {"w1": "gone"})
    r.run_to_replay()
    assert log.states() == ["planning", "remapping", "restoring", "fencing", "planning", "remapping", "restoring",
                            "replaying"]
    assert [c[1] for c in job.calls if c[0] == "fence"] == ["w1", "w2"]
    assert job.placement["s1"].worker == "w3" and r.record.attempts == 2
    assert r.data.setbacks == {Verdict.LOST: 1}


def test_a_survivor_lost_during_rewire_joins_the_recovery() -> None:
    job = FakeJob(spares=["w2", "w3"], commits=[commits_at(10)], rewire_failures=[{"w0": lost("w0")}])
    r, _, _ = recovery(job, {"w1": "gone"})
    r.run_to_replay()
    assert set(r.record.lost) == {"w0", "w1"} and {job.placement["s0"].worker, job.placement["s1"].worker} == {"w2", "w3"}
    assert ("fence", "w0", 100) in job.calls


def test_a_corrupt_cut_is_decommitted_and_every_slice_restarts_from_the_older_cut() -> None:
    job = FakeJob(spares=["w2"], commits=[commits_at(5, 10)], load_failures=[{"w2": corrupt("w2", "s1", 10)}])
    r, log, _ = recovery(job, {"w1": "gone"})
    r.run_to_replay()
    assert ("drop", "s1", 10) in job.calls
    assert ("reset_all",) in job.calls and ("load", ("w0", "w2"), 5, None) in job.calls
    assert r.record.policy == "restart-all" and r.record.checkpoint_step == 5
    assert "did not restore" in r.record.escalated
    assert log.states()[3:5] == ["planning", "remapping"]  # RESTORING -> PLANNING, no refencing


def test_the_cut_read_again_on_each_attempt_may_have_moved() -> None:
    job = FakeJob(spares=["w2", "w3"], commits=[commits_at(10), commits_at(10, 15)],
                  load_failures=[{"w2": lost("w2")}])
    r, _, _ = recovery(job, {"w1": "gone"})
    r.run_to_replay()
    loads = [c for c in job.calls if c[0] == "load"]
    assert [c[2] for c in loads] == [10, 15] and r.record.checkpoint_step == 15


def test_a_live_worker_that_refuses_is_asked_again_after_a_pause_on_the_clock() -> None:
    job = FakeJob(spares=["w2"], commits=[commits_at(10)], load_failures=[{"w2": refused("w2")}],
                  registered={"w2": True})
    r, _, clock = recovery(job, {"w1": "gone"})
    t0 = clock.monotonic()
    r.run_to_replay()
    assert clock.monotonic() - t0 >= 1.0
    assert [c for c in job.calls if c[0] == "fence"] == [("fence", "w1", 101)]  # nobody else fenced
    assert len([c for c in job.calls if c[0] == "load"]) == 2


def test_a_refusal_from_an_ended_incarnation_fences_it() -> None:
    job = FakeJob(spares=["w2", "w3"], commits=[commits_at(10)], load_failures=[{"w2": refused("w2")}],
                  registered={"w2": False})
    r, _, _ = recovery(job, {"w1": "gone"})
    r.run_to_replay()
    assert job.placement["s1"].worker == "w3" and "w2" in r.data.lost_workers


def test_a_short_output_log_escalates_to_restart_all_at_the_same_cut() -> None:
    short = WorkerCallFailed("w0", "Rewire", C.OUT_OF_RANGE, "log starts at 12")
    job = FakeJob(spares=["w2"], commits=[commits_at(10)], rewire_failures=[{"w0": short}])
    r, _, _ = recovery(job, {"w1": "gone"})
    r.run_to_replay()
    assert r.record.policy == "restart-all" and r.record.checkpoint_step == 10
    assert ("reset_all",) in job.calls and "output log" in r.record.escalated


def test_losses_past_the_budget_fail_the_recovery_with_the_count_and_limit() -> None:
    job = FakeJob(spares=["w2", "w3", "w4"], commits=[commits_at(10)],
                  load_failures=[{"w2": lost("w2")}, {"w3": lost("w3")}])
    r, _, _ = recovery(job, {"w1": "gone"}, budget=Budget(lost=1))
    with pytest.raises(JobFailed, match=r"lost setbacks 2 > limit 1"):
        r.run_to_replay()
    assert r.phase is P.FAILED


def test_no_spare_fails_the_recovery_from_remapping() -> None:
    job = FakeJob(spares=[], commits=[commits_at(10)])
    r, _, _ = recovery(job, {"w1": "gone"})
    with pytest.raises(JobFailed, match="no spare for s1"):
        r.run_to_replay()
    assert r.phase is P.FAILED


def test_the_lost_worker_back_as_a_new_incarnation_takes_its_own_slice_back() -> None:
    # w1 (incarnation 101) is lost; it registers again (incarnation 300) before the remap, and no other spare exists.
    job = FakeJob(spares=["w1"], commits=[commits_at(10)], incarnations={"w1": 300})
    r, _, _ = recovery(job, {"w1": "partitioned"})
    r.run_to_replay()
    assert job.placement["s1"] == SlicePlace("w1", "w1:1", 300, (0,)) and r.record.moved == {"s1": "w1"}
    assert ("load", ("w1",), 10, None) in job.calls and ("fence", "w1", 101) in job.calls


def test_the_lost_incarnation_itself_is_never_taken_back() -> None:
    # The registration of the lost incarnation is still visible (the fence has not landed in the snapshot yet).
    job = FakeJob(spares=["w1"], commits=[commits_at(10)], incarnations={"w1": 101})
    r, _, _ = recovery(job, {"w1": "hung"})
    with pytest.raises(JobFailed, match="no spare for s1"):
        r.run_to_replay()


def test_a_worker_lost_twice_in_one_recovery_is_excluded_up_to_its_newest_lost_incarnation() -> None:
    # w1 is lost (101), comes back (300) and takes s1, is lost again while loading; w2 is the next spare.
    job = FakeJob(spares=["w1", "w2"], commits=[commits_at(10)], incarnations={"w1": 300},
                  load_failures=[{"w1": lost("w1")}])
    r, _, _ = recovery(job, {"w1": "gone"})
    r.run_to_replay()
    assert [c[1:] for c in job.calls if c[0] == "fence"] == [("w1", 101), ("w1", 300)]
    assert job.placement["s1"].worker == "w2" and r.data.lost_incarnations == {"w1": 300}


def test_a_newer_loss_supersedes_a_recovery_still_replaying() -> None:
    job = FakeJob(spares=["w2"], commits=[commits_at(10)])
    r, _, _ = recovery(job, {"w1": "gone"})
    r.run_to_replay()
    assert r.phase is P.REPLAYING
    r.supersede("recovery 2 started")
    assert isinstance(r.state, Done) and {"replay", "catch_up"} <= set(r.record.marks)
    r2 = recovery(FakeJob(spares=["w2"], commits=[commits_at(10)]), {"w1": "gone"})[0]
    r2.run_to_replay()
    r2._set(CatchingUp())
    r2.supersede("the job ended")
    assert r2.phase is P.DONE


def test_the_skip_replay_hook_starts_the_moved_slice_where_it_had_got() -> None:
    job = FakeJob(spares=["w2"], commits=[commits_at(10)])
    r, _, _ = recovery(job, {"w1": "gone"}, hooks=ExecutorHooks(skip_replay=True))
    r.run_to_replay()
    assert ("load", ("w2",), 10, 13) in job.calls


def test_transitions_outside_the_table_are_refused() -> None:
    job = FakeJob(spares=["w2"], commits=[commits_at(10)])
    r, _, _ = recovery(job, {"w1": "gone"})
    with pytest.raises(AssertionError, match="no transition fencing -> replaying"):
        r._set(type("X", (), {"phase": P.REPLAYING})())  # type: ignore[arg-type]
    assert all(P.FAILED in TRANSITIONS[p] or p in (P.REPLAYING, P.CATCHING_UP) or p.is_terminal for p in P)


def program_failed(worker: str) -> WorkerCallFailed:
    from rallypoint.proto.errors import program_failed_metadata

    return WorkerCallFailed(worker, "LoadJob", C.INTERNAL,
                            f"loading job 'j': state 'p1' init failed on worker {worker}: RESOURCE_EXHAUSTED",
                            program_failed_metadata("state 'p1' init", "JaxRuntimeError: RESOURCE_EXHAUSTED"))


def test_the_programs_own_failure_on_the_spare_fails_the_recovery_at_once_fencing_only_the_lost_worker() -> None:
    job = FakeJob(spares=["w2", "w3"], commits=[commits_at(10)], load_failures=[{"w2": program_failed("w2")}])
    r, _, _ = recovery(job, {"w1": "gone"})
    with pytest.raises(JobFailed, match=r"state 'p1' init failed on worker w2: RESOURCE_EXHAUSTED"):
        r.run_to_replay()
    assert [c for c in job.calls if c[0] == "fence"] == [("fence", "w1", 101)]  # the spare is not blamed
    assert job.spares == ["w3"] and r.phase is P.FAILED  # and no other spare is tried


def test_a_cancelled_load_on_a_live_spare_is_asked_again_never_suspected() -> None:
    cancelled = WorkerCallFailed("w2", "LoadJob", C.CANCELLED, "Cancelled")
    job = FakeJob(spares=["w2", "w3"], commits=[commits_at(10)], load_failures=[{"w2": cancelled}],
                  registered={"w2": True})
    r, _, _ = recovery(job, {"w1": "gone"})
    r.run_to_replay()
    assert [c for c in job.calls if c[0] == "fence"] == [("fence", "w1", 101)]
    assert job.placement["s1"].worker == "w2" and r.data.setbacks == {Verdict.CANCELLED: 1}


def test_a_live_worker_lost_only_for_the_job_is_unloaded_not_fenced_and_may_take_its_slice_back() -> None:
    # A multi-host slice led by w1 lost another member: w1 itself is alive, so only the job's runtime on it ends
    # (its other jobs go on); its devices let go, it is a spare like any other for this very recovery.
    job = FakeJob(spares=[], commits=[commits_at(10)])
    r, _, _ = recovery(job, {"w1": "member w5 of multi-host slice 's1' lost", "w5": "gone"}, unload=frozenset({"w1"}))
    r.run_to_replay()
    assert ("unload", "w1") in job.calls and not [c for c in job.calls if c[0] == "fence"], job.calls
    assert job.placement["s1"].worker == "w1" and r.record.lost == {"w1": ["s1"]}
    assert ("load", ("w1",), 10, None) in job.calls


def test_a_live_worker_that_does_not_answer_its_unload_is_fenced() -> None:
    job = FakeJob(spares=["w2"], commits=[commits_at(10)])
    job.unanswered.add("w1")
    r, _, _ = recovery(job, {"w1": "member lost"}, unload=frozenset({"w1"}))
    r.run_to_replay()
    assert ("unload", "w1") in job.calls and ("fence", "w1", 101) in job.calls
    assert job.placement["s1"].worker == "w2"


def test_the_recovery_alone_writes_its_record_the_wait_a_remap_returns_and_the_runtimes_it_restored() -> None:
    """A remap returns the seconds it waited for a spare and the port tells the runtimes; the recovery writes
    both into its own record (the placement and the executor no longer reach into it)."""
    job = FakeJob(spares=["w2"], commits=[commits_at(10)])
    job.spare_wait_s, job.generations = 2.5, {"w0": 3, "w2": 9}
    r, _, _ = recovery(job, {"w1": "gone"})
    assert r.record.spare_wait_s == 0.0 and r.record.generations == {}
    r.run_to_replay()
    assert r.record.spare_wait_s == 2.5 and r.record.to_json()["spare_wait_s"] == 2.5
    assert r.record.generations == {"w0": 3, "w2": 9}
    job.generations["w2"] = 10  # a copy: what the port holds later does not change the record
    assert r.record.generations["w2"] == 9

