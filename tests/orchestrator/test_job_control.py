"""The leader's side of cancel, suspend, resume and history (orchestrator/service/verbs.py), on a MemoryStore
with stand-in executors: each refusal names what is wrong and what to do and changes nothing; a request taken is
kept in etcd and handed to the job's executor; a cancel of a suspended job moves its record; a retried submit
follows the run it started; the auto-resume waits for the asking job and for room; ended history expires."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.orchestrator.service import jobs as service_mod
from rallypoint.orchestrator.service.verbs import expired, room_to_resume
from rallypoint.orchestrator.job.stop import StopRequest
from rallypoint.orchestrator.job.runs import JOBSPEC_FILE
from rallypoint.proto import rallypoint_pb2 as pb
from tests.fakes import register_worker
from tests.fakes_service import Aborted, Context, StandInExecutor, service_with_stand_ins


class Executor(StandInExecutor):
    """A stand-in executor with what the verbs read of its view: its run (a run directory, or none)."""

    checkpoints = True

    def __init__(self, spec: pb.JobSpec, **kw: Any) -> None:
        super().__init__(spec, **kw)
        self.run_dir = Path(kw["checkpoint_root"]) / spec.job / "run-1" if Executor.checkpoints else None
        self.run_id = "run-1"


@pytest.fixture
def svc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Any, Any]:
    service, c = service_with_stand_ins(monkeypatch, tmp_path)
    monkeypatch.setattr(service_mod, "JobExecutor", Executor)
    Executor.checkpoints = True
    c.election.fenced_txn = lambda compares, success, failure=(): c.store.txn(compares, success, failure)
    c.config.keep_history_s = 3600.0
    return service, c


def spec(job: str = "a", submit_id: str = "") -> pb.JobSpec:
    s = pb.JobSpec(job=job, steps=3, submit_id=submit_id)
    s.slices.add(slice="s0")
    return s


def saved_run(root: Path, job: str) -> Path:
    """``<root>/<job>/run-1`` with the job's spec, the newest run on disk (what a resume reads)."""
    rd = root / job / "run-1"
    rd.mkdir(parents=True)
    (rd / JOBSPEC_FILE).write_bytes(spec(job).SerializeToString())
    (root / job / "LATEST").write_text("run-1\n")
    return rd


def snapshot(c: Any) -> dict[str, int]:
    return {kv.key: kv.mod_revision for kv in c.store.get_prefix(c.keys.prefix)[0]}


def refused(call: Any, code: grpc.StatusCode) -> str:
    with pytest.raises(Aborted) as err:
        call()
    assert err.value.code == code, err.value
    return err.value.details


def ask(svc: Any, verb: str, job: str, **kw: Any) -> Any:
    method = svc.CancelJob if verb == "cancel" else svc.SuspendJob
    return lambda: method(pb.JobControlRequest(job=job, **kw), Context())


def test_a_request_for_a_job_the_cluster_does_not_have_or_cannot_name_is_refused(svc: tuple[Any, Any]) -> None:
    s, c = svc
    before = snapshot(c)
    assert "has no job 'nope'" in refused(ask(s, "cancel", "nope"), grpc.StatusCode.NOT_FOUND)
    assert "cannot suspend job '../x'" in refused(ask(s, "suspend", "../x"), grpc.StatusCode.INVALID_ARGUMENT)
    assert snapshot(c) == before


def test_a_suspend_is_kept_in_etcd_handed_to_the_executor_and_a_second_request_changes_nothing(
    svc: tuple[Any, Any],
) -> None:
    s, c = svc
    run = s._start(spec(), resume=False, adopted=False)
    reply = ask(s, "suspend", "a", by="operator ann", reason="maintenance")()
    assert reply.state == "running" and "suspended at its next step boundary, every slice saved" in reply.message
    kept = json.loads(c.store.get(c.keys.control("a")).value)
    assert kept["action"] == "suspend" and kept["by"] == "operator ann" and kept["checkpoint"] is True
    assert [r.by for r in run.executor.stops_asked] == ["operator ann"]
    before = snapshot(c)
    for verb in ("suspend", "cancel"):
        why = refused(ask(s, verb, "a", by="operator bo"), grpc.StatusCode.FAILED_PRECONDITION)
        assert "already being suspended (asked by operator ann" in why and "nothing changed" in why
    assert snapshot(c) == before and len(run.executor.stops_asked) == 1
    run.executor.go.set()


def test_a_job_without_checkpoints_can_be_cancelled_but_not_suspended_nor_given_a_final_cut(
    svc: tuple[Any, Any],
) -> None:
    s, c = svc
    Executor.checkpoints = False
    run = s._start(spec(), resume=False, adopted=False)
    before = snapshot(c)
    assert "keeps no checkpoints: a suspend needs them" in refused(ask(s, "suspend", "a"),
                                                                   grpc.StatusCode.FAILED_PRECONDITION)
    assert "a final cut needs them" in refused(ask(s, "cancel", "a", checkpoint=True),
                                               grpc.StatusCode.FAILED_PRECONDITION)
    assert snapshot(c) == before and run.executor.stops_asked == []
    assert "without a final checkpoint" in ask(s, "cancel", "a")().message
    run.executor.go.set()


def test_a_job_that_is_over_refuses_every_verb_and_a_succeeded_one_refuses_a_resume(
    svc: tuple[Any, Any], tmp_path: Path,
) -> None:
    s, c = svc
    rd = saved_run(tmp_path, "a")
    c.store.put(c.keys.control("a"), json.dumps(StopRequest("suspend").to_json()))  # left by a lost leader
    for state in ("succeeded", "failed", "cancelled"):
        c.store.put(c.keys.job("a"), json.dumps({"job": "a", "state": state, "run": "run-1", "run_dir": str(rd)}))
        before = snapshot(c)
        for verb in ("cancel", "suspend"):
            why = refused(ask(s, verb, "a"), grpc.StatusCode.FAILED_PRECONDITION)
            assert f"already {state}: there is nothing to {verb}; nothing changed" in why
        assert snapshot(c) == before
    c.store.put(c.keys.job("a"), json.dumps({"job": "a", "state": "succeeded", "run": "run-1", "run_dir": str(rd)}))
    before = snapshot(c)
    with pytest.raises(Aborted) as err:
        next(iter(s.ResumeJob(pb.ResumeRequest(job="a"), Context())))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "is succeeded" in err.value.details
    assert snapshot(c) == before and Executor.made == []


def test_a_cancel_of_a_suspended_job_moves_its_record_and_a_resume_continues_the_cancelled_run(
    svc: tuple[Any, Any], tmp_path: Path,
) -> None:
    s, c = svc
    rd = saved_run(tmp_path, "a")
    c.store.put(c.keys.job("a"), json.dumps({"job": "a", "state": "suspended", "run": "run-1", "run_dir": str(rd),
                                             "stop": StopRequest("suspend", by="operator cy").to_json()}))
    before = snapshot(c)
    assert "already suspended" in refused(ask(s, "suspend", "a"), grpc.StatusCode.FAILED_PRECONDITION)
    assert snapshot(c) == before
    reply = ask(s, "cancel", "a", by="operator dee")()
    assert reply.state == "cancelled" and "was suspended and is now cancelled" in reply.message
    rec = json.loads(c.store.get(c.keys.job("a")).value)
    assert rec["state"] == "cancelled" and rec["stop"]["by"] == "operator dee" and rec["ended_at"] > 0
    assert c.store.get(c.keys.control("a")) is None  # nothing ran: nothing to hand over
    c.store.put(c.keys.control("a"), json.dumps(StopRequest("cancel").to_json()))  # a stale request
    events = s.ResumeJob(pb.ResumeRequest(job="a"), Context())
    assert next(iter(events)).event == "job.placed"
    (x,) = Executor.made
    assert x.resume and c.store.get(c.keys.control("a")) is None  # the resume is the newer word
    x.go.set()


def test_a_submit_retried_with_its_key_follows_the_run_it_started_and_another_key_is_refused(
    svc: tuple[Any, Any],
) -> None:
    s, c = svc
    first = s.SubmitJob(spec(submit_id="k1"), Context())
    assert next(first).event == "job.placed"
    again = s.SubmitJob(spec(submit_id="k1"), Context())
    watching = next(again)
    assert watching.event == "job.watching" and len(Executor.made) == 1
    with pytest.raises(Aborted) as err:
        next(s.SubmitJob(spec(submit_id="k2"), Context()))
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    Executor.made[0].go.set()
    assert [e.event for e in again] == ["job.finished"]


def test_a_job_suspended_for_a_higher_priority_one_resumes_once_that_job_ended_and_room_returned(
    svc: tuple[Any, Any], tmp_path: Path,
) -> None:
    s, c = svc
    rd = saved_run(tmp_path, "low")
    stop = StopRequest("suspend", by="job high (priority 5)", auto_resume=True).to_json()
    c.store.put(c.keys.job("low"), json.dumps({"job": "low", "state": "suspended", "run": "run-1",
                                               "run_dir": str(rd), "stop": stop}))
    c.store.put(c.keys.job("high"), json.dumps({"job": "high", "state": "running"}))
    c.store.put(c.keys.yield_slice("low", "s0"), json.dumps({"for": "high", "priority": 5}))
    assert s.control.resume_ready(7) == []  # the asking job still runs
    c.store.put(c.keys.job("high"), json.dumps({"job": "high", "state": "succeeded"}))
    assert s.control.resume_ready(7) == []  # no worker has room
    register_worker(c.store, c.keys, "w0", 1)
    assert s.control.resume_ready(7) == ["low"]
    assert c.store.get(c.keys.yield_slice("low", "s0")) is None  # the ended job's request went with it
    (x,) = Executor.made
    assert x.resume and not x.adopted and x.auto_resumed
    x.go.set()


def test_the_history_past_its_keep_is_removed_from_etcd_and_the_rest_stays(svc: tuple[Any, Any]) -> None:
    s, c = svc
    k, now = c.keys, c.clock.wall()
    old, recent = now - 7200, now - 60
    records = {"done": ("succeeded", old), "gone": ("cancelled", old), "fresh": ("failed", recent),
               "aside": ("suspended", old), "live": ("running", None)}
    for job, (state, ended) in records.items():
        c.store.put(k.job(job), json.dumps({"job": job, "state": state, **({"ended_at": ended} if ended else {})}))
        c.store.put(k.checkpoint(job, "s0", 5), "{}")
    c.store.put(k.old_run("live", "run-0"), json.dumps({"job": "live", "state": "succeeded", "superseded_at": old}))
    c.store.put(f"{k.runs('live')}run-0/checkpoints/s0/5", "{}")
    gone = s.control.sweep_history(now)
    assert sorted(gone) == sorted([k.job("done"), k.checkpoints("done"), k.job("gone"), k.checkpoints("gone"),
                                   f"{k.runs('live')}run-0/"])
    left = {kv.key for kv in c.store.get_prefix(k.jobs)[0]}
    assert {k.job("fresh"), k.job("aside"), k.job("live"), k.checkpoint("aside", "s0", 5)} <= left
    assert not any(key.startswith((k.job("done"), k.job("gone"), f"{k.runs('live')}run-0/")) for key in left)
    assert expired(k, {k.job("done"): {"state": "succeeded", "ended_at": old}}, 0.0, now) == []  # 0: for ever


def test_history_expires_when_the_leader_s_clock_moves_past_its_keep_with_no_real_wait(svc: tuple[Any, Any]) -> None:
    """The sweep reads the time from the coordinator's clock: a record that ended 60 s ago (on that clock) stays;
    once the fake clock moves past keep_history_s it is removed, and a cancel of a suspended job is stamped
    with that clock's time."""
    s, c = svc
    k, ended = c.keys, c.clock.wall() - 60
    c.store.put(k.job("done"), json.dumps({"job": "done", "state": "succeeded", "ended_at": ended}))
    assert s.control.sweep_history() == [] and c.store.get(k.job("done")) is not None
    c.clock.advance(3600.0)  # keep_history_s of the fixture: the record is now 3660 s old
    assert s.control.sweep_history() == [k.job("done"), k.checkpoints("done")]
    assert c.store.get(k.job("done")) is None
    c.store.put(k.job("aside"), json.dumps({"job": "aside", "state": "suspended", "run_dir": "/r"}))
    reply = s.control._cancel_suspended("aside", c.store.get(k.job("aside")).json(),
                                        c.store.get(k.job("aside")).mod_revision, StopRequest("cancel"), Context())
    assert reply.state == "cancelled"
    assert c.store.get(k.job("aside")).json()["ended_at"] == c.clock.wall()


def test_room_to_resume_counts_the_free_devices_of_eligible_workers_at_any_declared_count(
    svc: tuple[Any, Any],
) -> None:
    _s, c = svc
    job = spec("j")
    job.slices[0].mesh_shape[:] = [2]
    register_worker(c.store, c.keys, "w0", 1)
    assert not room_to_resume(read_cluster(c.store, c.keys), job)  # two devices on one worker: none has them
    job.nodes.add(name="n", slice="s0").variants.add(devices=1, mesh_shape=[1])  # declared devices=(1, 2)
    assert room_to_resume(read_cluster(c.store, c.keys), job)
    c.store.put(c.keys.cordon("w0"), "{}")
    assert not room_to_resume(read_cluster(c.store, c.keys), job)
