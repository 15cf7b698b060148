"""Runs of a job name: a new run keeps the previous one under its run id; retention and delete-run;
names and directories from requests and from etcd are checked before they touch the file system."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from rallypoint.basics.errors import ConfigError
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.orchestrator.job.state import JobFailed, JobState
from rallypoint.orchestrator.job.runs import (check_checkpoint_root, 
    LATEST_FILE, adoptable_run_dir, check_init_from, check_spec_names, delete_run, old_runs, previous_run, refusal,
    request_checkpoint_dir, run_dir,
)
from rallypoint.proto import rallypoint_pb2 as pb
from tests.fakes import MemoryStore
from tests.helpers.executor import Harness, pipeline_spec
from tests.helpers.executor import a_run


def test_a_new_run_keeps_the_previous_runs_record_and_commits_under_its_run_id(tmp_path: Path) -> None:
    first = a_run(tmp_path)
    old_id, old_dir = first.x.run_id, first.x.run_dir
    assert first.record()["run"] == old_id == old_dir.name
    second = Harness(tmp_path, store=first.store)
    assert second.x.run() is JobState.SUCCEEDED
    keys = first.keys
    assert second.record()["run"] == second.x.run_id != old_id
    kept = first.store.get_prefix(keys.old_run_checkpoints("pipe", old_id))[0]
    assert sorted(keys.tail(kv.key, keys.old_run_checkpoints("pipe", old_id)) for kv in kept) == \
        [[s, f"{step:012d}"] for s in ("s0", "s1") for step in (5, 7, 10, 15, 20)]
    assert [kv.value for kv in kept if kv.key.endswith("7")] == \
        [json.dumps(CheckpointCommit("pipe", s, 7, str(old_dir / s / "7"), "x").to_json()).encode() for s in ("s0", "s1")]
    live = first.store.get_prefix(keys.checkpoints("pipe"))[0]  # the new run's own commits, none of the old run's
    assert sorted(int(kv.key.rsplit("/", 1)[1]) for kv in live) == [5, 5, 10, 10, 15, 15, 20, 20]  # 20: the final cut
    (earlier,) = old_runs(first.store, keys, "pipe")
    assert earlier["run"] == old_id and earlier["state"] == "succeeded" and earlier["commits"] == 10
    assert old_dir.is_dir() and (old_dir / "commits" / "s0").is_dir()  # its files stay
    assert (tmp_path / "pipe" / LATEST_FILE).read_text().strip() == second.x.run_id


def test_refusal_names_resume_and_new_run_and_sees_commits_left_only_on_disk(tmp_path: Path) -> None:
    h = a_run(tmp_path)
    prev = previous_run(h.store, h.keys, "pipe", tmp_path)
    why = refusal(prev)
    assert "`rallypoint resume pipe`" in why and "--new-run" in why and h.x.run_id in why and "up to step 20" in why
    empty = MemoryStore()  # etcd lost (a new cluster): the copies beside the checkpoints still count
    prev = previous_run(empty, h.keys, "pipe", tmp_path)
    assert prev is not None and prev.commits == 2 and prev.run == h.x.run_id and refusal(prev)
    assert refusal(previous_run(empty, h.keys, "other", tmp_path)) == ""


def test_retention_keeps_the_newest_earlier_runs_and_deletes_the_rest(tmp_path: Path) -> None:
    runs = [a_run(tmp_path, keep_runs=1)]
    for _ in range(2):
        runs.append(a_run(tmp_path, runs[0].store, keep_runs=1))
    ids = [r.x.run_id for r in runs]
    assert [r["run"] for r in old_runs(runs[0].store, runs[0].keys, "pipe")] == [ids[1]]
    assert not (tmp_path / "pipe" / ids[0]).exists() and (tmp_path / "pipe" / ids[1]).is_dir()
    assert runs[0].store.get_prefix(runs[0].keys.runs("pipe") + ids[0] + "/")[0] == []


def test_delete_run_deletes_an_earlier_run_only(tmp_path: Path) -> None:
    first = a_run(tmp_path)
    second = a_run(tmp_path, first.store)
    store, keys = first.store, first.keys

    def txn(ops: list) -> None:
        store.txn([], ops)
    with pytest.raises(ConfigError, match="current run"):
        delete_run(store, keys, txn, "pipe", second.x.run_id, str(tmp_path))
    with pytest.raises(ConfigError, match="no earlier run"):
        delete_run(store, keys, txn, "pipe", "run-20000101T000000-000000", str(tmp_path))
    with pytest.raises(ConfigError, match="not a run id"):
        delete_run(store, keys, txn, "pipe", "../pipe", str(tmp_path))
    gone = delete_run(store, keys, txn, "pipe", first.x.run_id, str(tmp_path))
    assert gone["etcd_keys"] == 11 and not (tmp_path / "pipe" / first.x.run_id).exists()
    assert old_runs(store, keys, "pipe") == [] and (tmp_path / "pipe" / second.x.run_id).is_dir()


def test_checkpoint_directories_from_requests_stay_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "escape")
    assert request_checkpoint_dir("", str(root)) == str(root)
    assert request_checkpoint_dir("sub", str(root)) == str(root / "sub")
    assert request_checkpoint_dir(str(root / "sub"), str(root)) == str(root / "sub")
    for bad, why in (("../outside", "'..' is not allowed"), ("sub/../../outside", "'..' is not allowed"),
                     (str(tmp_path / "outside"), "outside the checkpoint root"), ("/etc", "outside the checkpoint root"),
                     ("escape", "outside the checkpoint root"), ("escape/deeper", "outside the checkpoint root")):
        with pytest.raises(ConfigError, match=why):
            request_checkpoint_dir(bad, str(root))
    with pytest.raises(ConfigError, match="started without --checkpoint-dir"):
        request_checkpoint_dir("sub", "")
    assert sorted(p.name for p in (tmp_path / "outside").iterdir()) == []


def test_a_pretrained_checkpoint_a_worker_reads_is_absolute_and_outside_every_jobs_runs(tmp_path: Path) -> None:
    """init_from (docs/checkpoints.md "Pretrained weights in"): the coordinator refuses, before anything is
    written, a path a worker would read that is relative, has '..', or lies under the checkpoint root (another
    job's runs), a symlink into it included."""
    root = tmp_path / "root"
    (root / "other-job" / "run-1").mkdir(parents=True)
    os.symlink(root / "other-job", tmp_path / "link")

    def spec(path: str) -> pb.JobSpec:
        return pb.JobSpec(job="j", states=[pb.StateProgram(name="s", slice="a", init_from=pb.InitFrom(path=path))])

    check_init_from(spec(str(tmp_path / "pretrained")), str(root))
    check_init_from(pb.JobSpec(job="j", states=[pb.StateProgram(name="s", slice="a")]), str(root))
    for bad, why in (("pretrained", "absolute path"), (str(tmp_path / "x" / ".." / "root"), "without '..'"),
                     (str(root / "other-job" / "run-1"), "under the coordinators' checkpoint root"),
                     (str(tmp_path / "link" / "run-1"), "under the coordinators' checkpoint root")):
        with pytest.raises(ConfigError, match=why):
            check_init_from(spec(bad), str(root))


def test_run_dirs_refuse_bad_job_names_latest_contents_and_symlinked_job_folders(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    for job in ("../x", "/abs", "a/b", ".."):
        with pytest.raises(ConfigError, match="invalid job name"):
            run_dir(root, job, create=True)
    os.symlink(tmp_path / "outside", root / "linked")
    with pytest.raises(ConfigError, match="outside the checkpoint root"):
        run_dir(root, "linked", create=True)
    assert list((tmp_path / "outside").iterdir()) == []
    (root / "j").mkdir()
    for latest in ("../../outside", "/etc", ""):
        (root / "j" / LATEST_FILE).write_text(latest + "\n")
        with pytest.raises(JobFailed, match="not a run id"):
            run_dir(root, "j", create=False)
    (root / "j" / "run-a").mkdir()
    (root / "j" / LATEST_FILE).write_text("run-a\n")
    assert run_dir(root, "j", create=False) == (root / "j" / "run-a").resolve()


def test_a_run_dir_read_back_from_etcd_is_checked_before_adoption(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "j" / "run-1").mkdir(parents=True)
    (tmp_path / "outside" / "j" / "run-1").mkdir(parents=True)
    os.symlink(tmp_path / "outside" / "j" / "run-1", root / "j" / "run-2")
    assert adoptable_run_dir(str(root / "j" / "run-1"), "j", str(root)) == (root / "j" / "run-1").resolve()
    for rd, why in ((str(tmp_path / "outside" / "j" / "run-1"), "outside the checkpoint root"),
                    (str(root / "j" / "run-2"), "outside the checkpoint root"),
                    (str(root / "k" / "run-1"), "not one of job 'j'"),
                    (str(root / "j" / "run-1" / ".." / "run-1"), "without '..'"),
                    ("j/run-1", "without '..'"), (str(root / "j" / ".hidden"), "not a run id")):
        with pytest.raises(ConfigError, match=why):
            adoptable_run_dir(rd, "j", str(root))
    with pytest.raises(ConfigError, match="without --checkpoint-dir"):
        adoptable_run_dir(str(root / "j" / "run-1"), "j", "")


def test_spec_names_that_become_folders_are_checked() -> None:
    check_spec_names(pipeline_spec())
    for mutate, what in ((lambda s: setattr(s, "job", "../x"), "job"),
                         (lambda s: setattr(s.slices[0], "slice", "../../etc"), "slice"),
                         (lambda s: setattr(s.nodes[0], "slice", "/abs"), "slice (of node"),
                         (lambda s: setattr(s.states[0], "slice", ".."), "slice (of state")):
        spec = pb.JobSpec()
        spec.CopyFrom(pipeline_spec())
        mutate(spec)
        with pytest.raises(ConfigError, match=re.escape(f"invalid {what}")):
            check_spec_names(spec)


def test_a_job_with_states_is_refused_by_coordinators_without_a_checkpoint_root() -> None:
    spec = pipeline_spec()
    with pytest.raises(ConfigError, match=r"has states.*start them with --checkpoint-dir ROOT.*nothing was started"):
        check_checkpoint_root(spec, "")
    check_checkpoint_root(spec, "/ck")  # a root: accepted
    del spec.states[:]
    check_checkpoint_root(spec, "")  # no states, no checkpoints: runs without a root
