"""Per-step metrics and non-finite values on a real local cluster: real etcd, a real worker process, a JAX
node whose loss becomes nan at a known step (the step comes from a JAX source).

One small cluster for the module (one worker of one device, one coordinator). With the
default ``on_nonfinite`` ("stop") the job fails at that step naming the metric, the step and
the cut it keeps, and no commit past the step is left; with "warn" it runs to its end with
one ``job.nonfinite`` event. Then ``rallypoint plot`` draws both runs from their
``metrics.jsonl`` (subprocesses, through ``--state-dir`` and through ``--cluster``), and the
leader's dashboard has their curves. (The same logic on fakes: tests/orchestrator/test_job_metrics.py;
``rallypoint plot`` after an embedded ``rallypoint run``: tests/integration/test_recovery.py.)
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest

from rallypoint.client import Program
from rallypoint.client.compile import compile_program
from rallypoint.client.submission import JobError, submit
from rallypoint.cluster.local import LocalCluster
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.etcd.commits import read_commit_records, read_commits
from rallypoint.orchestrator.job.metrics import METRICS_FILE, read_metrics
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.checkpoints.restore import restore_commit
from tests.helpers.cli import rp
from tests.helpers.cluster import run_dir_of, small_cluster

STEPS, EVERY, BAD_FROM = 12, 2, 7
PNG = b"\x89PNG\r\n\x1a\n"


def diverging(name: str) -> Program:
    """One slice: a state ``w`` and a loss that is finite before step ``BAD_FROM`` and log(-1) = nan from it on."""
    prog = Program(name, steps=STEPS, checkpoint_every=EVERY)
    s = prog.slice("s", devices=1)
    w = prog.state("w", slice=s, init=lambda: jnp.ones((4,), jnp.float32))
    data = prog.source("data", lambda step, mb: {"t": step.astype(jnp.float32)}, slice=s, outputs=("t",), per="step")

    def train(w: Any, t: Any) -> dict[str, Any]:
        loss = jnp.where(t >= BAD_FROM, jnp.log(-1.0), jnp.sum(w) / (1.0 + t))
        return {"w": w * 0.9, "loss": loss}

    node = prog.node("train", train, slice=s, inputs={"w": w, "t": data["t"]}, outputs=("w", "loss"), updates={"w": w})
    prog.metric("loss", node["loss"])
    return prog


@pytest.fixture(scope="module")
def lc(tmp_path_factory: pytest.TempPathFactory, compile_cache: Path) -> Iterator[LocalCluster]:
    with small_cluster(tmp_path_factory.mktemp("nonfinite"), compile_cache) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def stopped(lc: LocalCluster) -> dict[str, Any]:
    """Job ``nan-stop`` run with the default on_nonfinite: its error, its events, the workers' incarnations before."""
    events: list[pb.JobEvent] = []
    store = lc.store()
    try:
        before = {w: s.info.incarnation for w, s in read_cluster(store, lc.keys).workers.items()}
    finally:
        store.close()
    with pytest.raises(JobError) as info:
        submit(compile_program(diverging("nan-stop")), endpoints=lc.endpoints, cluster=lc.keys.cluster,
               on_event=events.append)
    return {"message": str(info.value), "events": events, "before": before}


@pytest.fixture(scope="module")
def warned(lc: LocalCluster) -> dict[str, Any]:
    """Job ``nan-warn`` run with on_nonfinite "warn": its result and events."""
    events: list[pb.JobEvent] = []
    result = submit(compile_program(diverging("nan-warn")), endpoints=lc.endpoints, cluster=lc.keys.cluster,
                    on_event=events.append, on_nonfinite="warn")
    return {"result": result, "events": events}


def test_a_nan_loss_stops_the_job_at_its_step_keeping_the_cut_before_it_and_no_commit_past_it(
    lc: LocalCluster, stopped: dict[str, Any],
) -> None:
    events, message, before = stopped["events"], stopped["message"], stopped["before"]
    store = lc.store()
    try:
        assert (f"metric 'loss' is nan at step {BAD_FROM} (--on-nonfinite stop): the job stopped there; the last "
                f"committed cut, step {BAD_FROM - 1}, is kept: fix the cause and resume from it") in message, message
        names = [e.event for e in events]
        assert "job.nonfinite" in names and "job.recovering" not in names, names
        record = store.get(lc.keys.job("nan-stop")).json()
        assert record["state"] == "failed" and record["failures"] == [] and record["recoveries"] == []
        assert record["cut"] == BAD_FROM - 1
        # No commit past the step, in etcd or beside the checkpoints; the cut kept is on disk and restorable.
        commits = read_commits(store, lc.keys, "nan-stop")["s"]
        assert max(c.step for c in commits) == BAD_FROM - 1, [c.step for c in commits]
        rd = run_dir_of(lc, "nan-stop")
        assert max(c.step for c in read_commit_records(rd)["s"]) == BAD_FROM - 1
        restore_commit(next(c for c in commits if c.step == BAD_FROM - 1))  # read back, checksum checked
        # It blamed no worker: the same incarnation, not fenced, holding nothing.
        snap = read_cluster(store, lc.keys)
        assert {w: s.info.incarnation for w, s in snap.workers.items()} == before
        assert not snap.lost and all(not s.holders for s in snap.workers.values())
    finally:
        store.close()
    got = read_metrics(rd / METRICS_FILE)
    assert got.steps == list(range(BAD_FROM)) and got.curve("loss")[0] == (0, 4.0)
    assert [(m["event"], m["step"], m["metric"], m["value"]) for m in got.marks] == [("nonfinite", BAD_FROM, "loss",
                                                                                      "nan")]


def test_with_warn_the_job_runs_to_its_end_with_one_warning_and_every_step_in_metrics_jsonl(
    lc: LocalCluster, warned: dict[str, Any],
) -> None:
    result, events = warned["result"], warned["events"]
    assert result.steps == STEPS
    warnings = [(e.step, json.loads(e.detail)) for e in events if e.event == "job.nonfinite"]
    assert [(s, d["metric"], d["value"], d["action"]) for s, d in warnings] == [(BAD_FROM, "loss", "nan", "warn")]
    got = read_metrics(run_dir_of(lc, "nan-warn") / METRICS_FILE)
    assert got.steps == list(range(STEPS))
    lines = (run_dir_of(lc, "nan-warn") / METRICS_FILE).read_text().splitlines()
    assert json.loads(lines[STEPS - 1])["metrics"] == {"loss": "nan"}  # JSON has no nan: the string


def test_an_unknown_on_nonfinite_is_refused_at_submit_naming_the_value_and_the_choices(lc: LocalCluster) -> None:
    with pytest.raises(JobError) as info:
        submit(compile_program(diverging("nan-bad")), endpoints=lc.endpoints, cluster=lc.keys.cluster,
               on_nonfinite="ignore")
    assert "INVALID_ARGUMENT" in str(info.value) and "on_nonfinite 'ignore' is not one of ['stop', 'warn', 'rollback']" in str(
        info.value)


def test_rallypoint_plot_draws_a_run_of_the_cluster_and_says_what_is_wrong(
    lc: LocalCluster, stopped: dict[str, Any], warned: dict[str, Any], tmp_path: Path,
) -> None:
    from matplotlib import image

    png = tmp_path / "stop.png"
    r = rp("plot", "nan-stop", "--state-dir", str(lc.config.state_dir), "--out", str(png))
    assert r.stdout.startswith(f"{png}: {BAD_FROM} steps (0..{BAD_FROM - 1}), loss 4 -> "), r.stdout
    assert "0 recoveries, non-finite: loss nan" in r.stdout, r.stdout
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 0 and image.imread(png).shape[0] > 100
    # Through etcd (the job's record names its run directory), as a client of another host would find it.
    png = tmp_path / "warn.png"
    cluster = f"{lc.keys.cluster}@{','.join(lc.endpoints)}"
    r = rp("plot", "nan-warn", "--cluster", cluster, "--tls-dir", str(lc.tls_dir), "--metric", "loss", "--out",
           str(png))
    assert f"{STEPS} steps (0..{STEPS - 1})" in r.stdout and png.read_bytes()[:8] == PNG
    bad = rp("plot", "no-such-job", "--state-dir", str(lc.config.state_dir), check=False)
    assert bad.returncode == 1 and "no run of job 'no-such-job'" in bad.stderr and "Traceback" not in bad.stderr
    bad = rp("plot", "nan-warn", "--state-dir", str(lc.config.state_dir), "--metric", "accuracy", check=False)
    assert bad.returncode == 1 and "has no metric 'accuracy'; its metrics are loss" in bad.stderr, bad.stderr


def test_the_dashboard_has_each_jobs_curve_with_the_nonfinite_step_marked(
    lc: LocalCluster, stopped: dict[str, Any], warned: dict[str, Any],
) -> None:
    url = lc.leader_dashboard()
    assert url
    with urllib.request.urlopen(url + "api/cluster", timeout=5) as resp:
        jobs = {j["job"]: j for j in json.loads(resp.read())["jobs"]}
    warn, stop = jobs["nan-warn"], jobs["nan-stop"]
    assert [s for s, _ in warn["metrics"]["loss"]] == list(range(STEPS))
    assert warn["metrics"]["loss"][BAD_FROM][1] is None and warn["metrics"]["loss"][0][1] == pytest.approx(4.0)
    assert [s for s, _ in stop["metrics"]["loss"]] == list(range(BAD_FROM))
    for j in (warn, stop):
        assert {"kind": "nonfinite", "step": BAD_FROM, "label": "loss nan"} in j["marks"]
        assert 'data-metric="loss"' in j["metrics_svg"] and 'data-kind="nonfinite"' in j["metrics_svg"]
