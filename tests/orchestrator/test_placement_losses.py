"""A worker lost while the job is being placed (between its device lease and the load) is one more loss for the
recovery machinery, never the job's end: a new job, an adopted one, a resumed one, a multi-host slice's member, and
the job's ``on_no_spare`` when no spare is left (docs/recovery.md, "Lost while the job is placed or loaded").

The loss is made where it happens in production: ExecutorHooks.leased runs once every slice is leased, and the
worker's registration goes there (its process died), before the placement looks at the cluster again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from rallypoint.orchestrator.job.state import JobState
from tests.fakes import MemoryStore
from tests.helpers.executor import Harness, join_while_waiting, pipeline_spec

Killer = Callable[[Mapping[str, tuple[str, ...]]], None]


def killing(slice_name: str, store: Callable[[], tuple[MemoryStore, Any]], member: int = 0,
            killed: list[str] | None = None) -> Killer:
    """The hook: the first time, the worker of ``slice_name`` (its ``member``-th, for a multi-host slice) dies."""
    killed = [] if killed is None else killed

    def kill(placed: Mapping[str, tuple[str, ...]]) -> None:
        if killed:
            return
        s, keys = store()
        victim = placed[slice_name][member]
        killed.append(victim)
        kv = s.get(keys.worker(victim))
        assert kv is not None
        s.revoke_lease(kv.lease)  # the process died: its registration goes with its lease

    return kill


def harness_killing(tmp_path: Path, slice_name: str, killed: list[str], *, member: int = 0,
                    **kw: Any) -> Harness:
    box: list[Harness] = []
    hooks = ExecutorHooks(leased=killing(slice_name, lambda: (box[0].store, box[0].keys), member, killed))
    box.append(Harness(tmp_path, hooks=hooks, **kw))
    return box[0]


def test_a_worker_lost_between_its_lease_and_the_load_is_recovered_and_the_job_succeeds(tmp_path: Path) -> None:
    killed: list[str] = []
    h = harness_killing(tmp_path, "s1", killed)
    assert h.x.run() is JobState.SUCCEEDED, h.record().get("reason")
    (victim,) = killed
    assert victim not in {w for w, _ in h.workers.loads}  # never loaded: it was gone before the load
    (rec,) = h.x.recovery.records
    assert rec.lost == {victim: ["s1"]} and "being placed" in rec.reasons[victim]
    assert h.worker_of("s1") not in (victim, h.worker_of("s0"))
    assert [f["worker"] for f in h.x.port.failures] == [victim]
    names = h.names()
    assert names.index("job.placed") < names.index("job.started") < names.index("job.recovering") \
        < names.index("job.recovered") < names.index("job.finished")
    assert [e.step for e in h.events if e.event == "step.done"] == list(range(20)) and h.leases() == []


def test_a_loss_while_placed_with_no_spare_fails_as_on_no_spare_fail_says_after_a_recovery(tmp_path: Path) -> None:
    h = harness_killing(tmp_path, "s1", [], workers=2, spec=pipeline_spec(on_no_spare="fail"))
    assert h.x.run() is JobState.FAILED
    reason = h.record()["reason"]
    assert "being placed" not in reason and "s1" in reason  # the recovery's remap decided, per on_no_spare
    assert len(h.x.recovery.records) == 1 and "job.recovering" in h.names() and h.leases() == []


def test_a_loss_while_placed_with_no_spare_waits_for_a_worker_as_on_no_spare_wait_says(tmp_path: Path) -> None:
    h = harness_killing(tmp_path, "s0", [], workers=2, spec=pipeline_spec(wait_timeout_s=30))
    joined = join_while_waiting(h)  # 5 s into the wait, a worker registers
    assert h.x.run() is JobState.SUCCEEDED, h.record().get("reason")
    assert joined and h.worker_of("s0") == "w9"
    waiting = [json.loads(e.detail) for e in h.events if e.event == "job.waiting"]
    assert len(waiting) == 1 and waiting[0]["recovery"] == 1 and list(waiting[0]["missing"]) == ["s0"]


def a_first_term_to_step_12(tmp_path: Path) -> MemoryStore:
    """A leader ran the job to step 12 (cut 10) on three of four workers and is gone (its term deposed)."""
    first = Harness(tmp_path, workers=4)
    first.x.begin()
    first.steps_until(12)
    for s in ("s0", "s1"):
        c = CheckpointCommit("pipe", s, 10, f"/ck/{s}/10", "x")
        first.store.put(first.keys.checkpoint("pipe", s, 10), json.dumps(c.to_json()))
    first.election.depose()
    return first.store


def test_an_adopting_placement_that_loses_a_worker_recovers_it_and_the_job_succeeds(tmp_path: Path) -> None:
    killed: list[str] = []
    h = harness_killing(tmp_path, "s1", killed, adopted=True, store=a_first_term_to_step_12(tmp_path))
    assert h.x.run() is JobState.SUCCEEDED, h.record().get("reason")
    (victim,) = killed
    (adopted,) = [e for e in h.events if e.event == "job.adopted"]
    assert adopted.step == 10 and {s for _w, s in h.workers.loads} == {10}
    (rec,) = h.x.recovery.records
    assert rec.lost == {victim: ["s1"]} and rec.checkpoint_step == 10 and h.worker_of("s1") != victim
    assert [e.step for e in h.events if e.event == "step.done"] == list(range(10, 20))


def test_a_resuming_placement_that_loses_a_worker_recovers_it_and_the_job_succeeds(tmp_path: Path) -> None:
    killed: list[str] = []
    h = harness_killing(tmp_path, "s0", killed, resume=True, store=a_first_term_to_step_12(tmp_path))
    assert h.x.run() is JobState.SUCCEEDED, h.record().get("reason")
    (victim,) = killed
    assert any(e.event == "job.resumed" for e in h.events) and victim not in {w for w, _ in h.workers.loads}
    (rec,) = h.x.recovery.records
    assert rec.lost == {victim: ["s0"]} and h.worker_of("s0") != victim


def test_a_gang_member_lost_while_placed_takes_its_gang_to_a_recovery_and_spares_its_lead(tmp_path: Path) -> None:
    spec = pipeline_spec()
    spec.slices[1].mesh_shape[:] = [2]  # s1 needs two devices; every worker has one: a gang of two
    killed: list[str] = []
    h = harness_killing(tmp_path, "s1", killed, member=1, workers=5, spec=spec)
    assert h.x.run() is JobState.SUCCEEDED, h.record().get("reason")
    (member,) = killed
    (placed,) = [json.loads(e.detail) for e in h.events if e.event == "job.placed"]
    lead, s0 = placed["s1"]["worker"], placed["s0"]["worker"]
    assert [m["worker"] for m in placed["s1"]["members"]] == [lead, member]
    assert h.workers.loads[0] == (s0, 0)  # the gang that lost a member is not loaded
    (rec,) = h.x.recovery.records
    assert rec.lost == {lead: ["s1"]}  # the slice is lost as a unit, with its lead's runtime
    assert h.store.get(h.keys.worker(lead)) is not None  # alive: its devices released, itself not fenced
    new = h.x.places.slices["s1"]
    assert member not in {m.worker for m in new.members} and len(new.members) == 2
    assert h.workers.loads[1] == (new.worker, 0)


def test_a_job_placed_without_losses_is_loaded_whole(tmp_path: Path) -> None:
    h = Harness(tmp_path, hooks=ExecutorHooks(leased=lambda placed: None))
    h.x.begin()
    assert h.x.recovery.records == [] and sorted(w for w, _ in h.workers.loads) == sorted(
        {h.worker_of("s0"), h.worker_of("s1")})
    assert h.x.state is JobState.RUNNING
