"""The coordinator service's side of runs: a resubmit that would start over a run with commits is refused
(FAILED_PRECONDITION, nothing changed), ``new_run`` starts one; names and directories from requests
and from etcd are refused before anything touches the file system."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from rallypoint.orchestrator.job.runs import JOBSPEC_FILE, LATEST_FILE
from rallypoint.proto import rallypoint_pb2 as pb
from tests.fakes_service import Aborted, Context, StandInExecutor, service_with_stand_ins


def spec(job: str = "a", **kw: Any) -> pb.JobSpec:
    s = pb.JobSpec(job=job, steps=3, **kw)
    s.slices.add(slice="s0")
    return s


def a_run_with_commits(c: Any, root: Path, job: str = "a") -> Path:
    rd = root / job / "run-20260101T000000-abcdef"
    rd.mkdir(parents=True)
    (rd / JOBSPEC_FILE).write_bytes(spec(job).SerializeToString())
    (root / job / LATEST_FILE).write_text(rd.name + "\n")
    c.store.put(c.keys.job(job), json.dumps({"job": job, "state": "failed", "run": rd.name, "run_dir": str(rd)}))
    c.store.put(c.keys.checkpoint(job, "s0", 5), json.dumps({"job": job, "slice": "s0", "step": 5,
                                                             "path": str(rd / "s0" / "5"), "checksum": "x"}))
    return rd


def snapshot(c: Any, root: Path) -> tuple[dict[str, int], list[str]]:
    return ({kv.key: kv.mod_revision for kv in c.store.get_prefix(c.keys.prefix)[0]},
            sorted(str(p.relative_to(root)) for p in root.rglob("*")))


def refused(call: Any, code: grpc.StatusCode) -> str:
    with pytest.raises(Aborted) as err:
        next(iter(call))
    assert err.value.code == code, err.value
    return err.value.details


def test_a_resubmit_of_a_name_with_commits_is_refused_and_changes_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    svc, c = service_with_stand_ins(monkeypatch, tmp_path)
    a_run_with_commits(c, tmp_path)
    before = snapshot(c, tmp_path)
    why = refused(svc.SubmitJob(spec(), Context()), grpc.StatusCode.FAILED_PRECONDITION)
    assert "`rallypoint resume a`" in why and "--new-run" in why and "run-20260101T000000-abcdef" in why
    assert StandInExecutor.made == [] and snapshot(c, tmp_path) == before


def test_a_submit_with_new_run_starts_a_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    svc, c = service_with_stand_ins(monkeypatch, tmp_path)
    a_run_with_commits(c, tmp_path)
    events = svc.SubmitJob(spec(new_run=True), Context())
    assert next(iter(events)).event == "job.placed"
    (x,) = StandInExecutor.made
    assert x.spec.new_run and not x.resume
    x.go.set()
    assert [e.event for e in events] == ["job.finished"]


def test_names_and_checkpoint_dirs_from_requests_are_refused_with_nothing_written(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")
    (root / "linked-job").symlink_to(tmp_path / "outside")
    svc, c = service_with_stand_ins(monkeypatch, root)
    before = snapshot(c, tmp_path)
    bad_slice = spec()
    bad_slice.slices[0].slice = "../../outside"
    for request, what in ((spec(checkpoint_dir="../outside"), "'..' is not allowed"),
                          (spec(checkpoint_dir=str(tmp_path / "outside")), "outside the checkpoint root"),
                          (spec(checkpoint_dir="escape"), "outside the checkpoint root"),
                          (spec(job="../a"), "invalid job name"), (bad_slice, "invalid slice name"),
                          (spec(job="linked-job"), "the job's folder")):
        assert what in refused(svc.SubmitJob(request, Context()), grpc.StatusCode.INVALID_ARGUMENT)
    for request, what in ((pb.ResumeRequest(job="a", checkpoint_dir="../outside"), "'..' is not allowed"),
                          (pb.ResumeRequest(job="a", checkpoint_dir="escape"), "outside the checkpoint root"),
                          (pb.ResumeRequest(job="../a"), "invalid job name")):
        assert what in refused(svc.ResumeJob(request, Context()), grpc.StatusCode.INVALID_ARGUMENT)
    assert StandInExecutor.made == [] and snapshot(c, tmp_path) == before


def test_resume_refuses_a_latest_that_leads_out_of_the_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    outside = tmp_path / "outside" / "run-x"
    outside.mkdir(parents=True)
    (outside / JOBSPEC_FILE).write_bytes(spec().SerializeToString())
    (root / "a" / LATEST_FILE).write_text("../../outside/run-x\n")
    svc, c = service_with_stand_ins(monkeypatch, root)
    assert "not a run id" in refused(svc.ResumeJob(pb.ResumeRequest(job="a"), Context()), grpc.StatusCode.NOT_FOUND)
    assert StandInExecutor.made == []


def test_adoption_reads_no_run_dir_outside_the_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    svc, c = service_with_stand_ins(monkeypatch, root)
    outside = a_run_with_commits(c, tmp_path / "elsewhere", "a")  # a record whose run_dir is not under the root
    c.store.put(c.keys.job("a"), json.dumps({"job": "a", "state": "running", "term": 3, "run_dir": str(outside)}))
    linked = root / "b" / "run-1"
    linked.parent.mkdir()
    linked.symlink_to(outside)  # under the root by name, outside it in fact
    c.store.put(c.keys.job("b"), json.dumps({"job": "b", "state": "running", "term": 3, "run_dir": str(linked)}))
    before = snapshot(c, tmp_path)
    svc.adoption.adopt_all(7)
    assert StandInExecutor.made == [] and snapshot(c, tmp_path) == before


def test_a_resubmit_of_a_job_recorded_as_running_is_answered_already_exists(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """A client that retried its submit on a new leader, which has yet to adopt the job: ALREADY_EXISTS (the
    client then follows the job there), and nothing is started or written."""
    svc, c = service_with_stand_ins(monkeypatch, tmp_path)
    rd = a_run_with_commits(c, tmp_path)
    c.store.put(c.keys.job("a"), json.dumps({"job": "a", "state": "running", "term": 3, "run": rd.name,
                                             "run_dir": str(rd)}))
    before = snapshot(c, tmp_path)
    why = refused(svc.SubmitJob(spec(), Context()), grpc.StatusCode.ALREADY_EXISTS)
    assert "recorded as running" in why and "adopts it" in why
    assert StandInExecutor.made == [] and snapshot(c, tmp_path) == before
