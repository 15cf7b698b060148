"""metrics.jsonl (the writer and the reader) and non-finite metrics, with the executor on fakes.

The same paths on a real cluster (real etcd, worker processes, a JAX node whose loss goes
to nan): tests/integration/test_nonfinite.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from rallypoint.etcd.commits import read_commits
from rallypoint.orchestrator.job.executor import run_dir
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.orchestrator.job.metrics import (METRICS_FILE, JobMetrics, MetricsLog, NonFinite, NonFiniteStop,
                                                 nonfinite_stop, parse_metrics, read_metrics)
from rallypoint.recovery.nonfinite import nonfinite_mode
from rallypoint.orchestrator.job.recovery import JobSettings
from rallypoint.orchestrator.job.state import JobState
from rallypoint.proto import rallypoint_pb2 as pb
from tests.fakes import FakeWorkers
from tests.helpers import executor as executor_harness
from tests.helpers.executor import Harness, pipeline_spec, progress, run


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append(("warning", event, kw))

    def error(self, event: str, **kw: Any) -> None:
        self.lines.append(("error", event, kw))


def test_the_reader_takes_the_last_value_per_step_and_keeps_the_marks() -> None:
    lines = [
        '{"step": 0, "t": 1.0, "metrics": {"loss": 2.0, "acc": 0.1}}',
        '{"step": 1, "t": 2.0, "metrics": {"loss": 1.5}}',
        '{"step": 2, "t": 3.0, "metrics": {"loss": 1.0}}',
        '{"event": "fault", "t": 3.5, "step": 3, "recovery": 1, "cause": "w1: event stream ended"}',
        '{"event": "recovery", "recovery": 1, "t": 3.5, "ended_t": 4.0, "step": 3, "from_step": 1, "cause": "w1", '
        '"replayed": 4}',
        '{"step": 2, "t": 4.5, "metrics": {"loss": 0.75}}',  # replayed: completed again, the last value counts
        '{"step": 3, "t": 5.0, "metrics": {"loss": "nan"}}',
        '{"step": 4, "t": 5.5, "metri',  # a line cut short by a crash
        "",
    ]
    run = parse_metrics(lines)
    assert run.names == ["acc", "loss"] and run.steps == [0, 1, 2, 3]
    curve = run.curve("loss")
    assert curve[:3] == [(0, 2.0), (1, 1.5), (2, 0.75)]
    assert curve[3][0] == 3 and math.isnan(curve[3][1])
    assert run.curve("acc") == [(0, 0.1)] and run.curve("nothing") == []
    assert run.skipped == 1
    assert [m["event"] for m in run.marks] == ["fault", "recovery"]
    assert run.recoveries() == [run.marks[1]]  # the recovery's own line wins over its fault line


def test_the_writer_appends_json_lines_and_a_refused_write_is_logged_once_and_never_raised(tmp_path: Path) -> None:
    log = _Log()
    path = tmp_path / METRICS_FILE
    w = MetricsLog(path, log)
    assert w.write({"step": 0, "t": 1.0, "metrics": {"loss": 1.0}})
    w.close()
    w = MetricsLog(path, log)  # a new leader appends to the same file
    assert w.write({"step": 1, "t": 2.0, "metrics": {"loss": 0.5}})
    w.close()
    assert read_metrics(path).curve("loss") == [(0, 1.0), (1, 0.5)]
    blocked = MetricsLog(tmp_path / "not-a-dir" / "x" / METRICS_FILE, log)  # the folder is missing: OSError
    assert not blocked.write({"step": 0}) and not blocked.write({"step": 1})
    assert [e for _, e, _ in log.lines] == ["job.metrics_write_failed"] and blocked.failures == 2
    assert not MetricsLog(None, log).write({"step": 0})  # a job without a run directory keeps no file


def test_on_nonfinite_is_stop_warn_rollback_or_empty_and_anything_else_names_the_choices() -> None:
    assert nonfinite_mode(pb.JobSpec()) == "stop" and nonfinite_mode(pb.JobSpec(on_nonfinite="warn")) == "warn"
    assert nonfinite_mode(pb.JobSpec(on_nonfinite="rollback")) == "rollback"
    with pytest.raises(ValueError, match=r"on_nonfinite 'ignore' is not one of \['stop', 'warn', 'rollback'\]"):
        nonfinite_mode(pb.JobSpec(on_nonfinite="ignore"))
    assert JobSettings.from_spec(pb.JobSpec(job="j", on_nonfinite="warn")).on_nonfinite == "warn"


def test_a_halted_progress_grants_nothing_more_and_no_commit_past_the_step_moves_the_cut() -> None:
    p = progress()
    p.widen(2)
    for s in range(3):
        run(p, s)
    assert p.commit("s0", 2) is None and p.commit("s1", 2) == 2
    granted = p.granted
    p.grants.halt(4)
    assert not p.widen(2) and p.granted == granted  # three steps done, but the window stays where it was
    assert p.commit("s0", 5) is None and p.commit("s1", 5) is None and p.cut == 2  # racing in: ignored
    assert p.commit("s0", 4) is None and p.commit("s1", 4) == 4  # at the step itself: counts


def _commits(**steps: list[int]) -> dict[str, list[CheckpointCommit]]:
    return {s: [CheckpointCommit("j", s, c, f"/ck/{s}/{c}", "x") for c in cs] for s, cs in steps.items()}


def test_check_returns_the_value_that_stops_the_job_and_moves_nothing() -> None:
    events: list[tuple[str, int]] = []
    m = JobMetrics(pb.JobSpec(job="j"), log=_Log(), event=lambda name, step=0, **kw: events.append((name, step)))
    assert m.check(pb.InstanceDone(node="fwd1", step=3, metrics={"loss": 1.0})) is None
    bad = m.check(pb.InstanceDone(node="fwd1", step=4, metrics={"loss": float("nan")}))
    assert bad is not None and (bad.metric, bad.step, bad.node) == ("loss", 4, "fwd1")
    assert events == [("job.nonfinite", 4)]
    m.mode = "warn"
    assert m.check(pb.InstanceDone(node="fwd1", step=5, metrics={"loss": float("inf")})) is None
    assert m.check(pb.InstanceDone(node="fwd1", step=6, metrics={"loss": float("inf")})) is None
    assert events == [("job.nonfinite", 4), ("job.nonfinite", 5)]  # warned once per metric


def test_a_nonfinite_stop_drops_the_commits_past_the_step_and_keeps_the_newest_cut_before_it() -> None:
    bad = NonFinite("loss", float("nan"), 7, "fwd1", 0)
    stop = nonfinite_stop(bad, ["s0", "s1"], 6, _commits(s0=[4, 6, 8], s1=[4, 6, 8]))
    assert stop.drop == (("s0", 8), ("s1", 8)) and stop.cut is None  # the cut stays at 6
    assert stop.reason.endswith("the last committed cut, step 6, is kept: fix the cause and resume from it")
    # s1's commit at 6 landed while the workers unloaded: the cut goes up to it
    up = nonfinite_stop(bad, ["s0", "s1"], 4, _commits(s0=[4, 6], s1=[4, 6]))
    assert (up.cut, dict(up.commits), up.drop) == (6, {"s0": [4, 6], "s1": [4, 6]}, ())
    # the cut had passed the step (the metric's slice keeps no states): down to the newest one at or before it
    down = nonfinite_stop(bad, ["s0"], 10, _commits(s0=[4, 10]))
    assert (down.cut, down.drop) == (4, (("s0", 10),))
    none = nonfinite_stop(bad, ["s0"], 0, _commits(s0=[8]))
    assert none.cut is None and none.drop == (("s0", 8),) and "no consistent cut was committed" in none.reason
    assert nonfinite_stop(bad, [], 0, {}) == NonFiniteStop(7, reason=none.reason)


def test_events_become_step_lines_and_marks(tmp_path: Path) -> None:
    m = JobMetrics(pb.JobSpec(job="j"), log=_Log(), event=lambda *a, **k: None, wall=lambda: 100.0)
    m.open(tmp_path, "stop")
    emitted: list[str] = []
    emit = m.tee(lambda ev: emitted.append(ev.event))
    emit(pb.JobEvent(job="j", event="step.done", step=0, metrics={"loss": 1.0}))
    emit(pb.JobEvent(job="j", event="job.recovering", step=3, detail=json.dumps({"recovery": 1, "lost": {"w1": "x"}})))
    emit(pb.JobEvent(job="j", event="job.recovered", step=2, detail=json.dumps(
        {"recovery": 1, "detected_at": 99.0, "checkpoint_step": 2, "reasons": {"w1": "x"},
         "planned_instances": {"fwd1": 3}})))
    emit(pb.JobEvent(job="j", event="step.done", step=1, metrics={"loss": float("inf")}))
    emit(pb.JobEvent(job="j", event="job.finished", step=2))
    assert emitted == ["step.done", "job.recovering", "job.recovered", "step.done", "job.finished"]
    lines = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert lines[0] == {"step": 0, "t": 100.0, "metrics": {"loss": 1.0}}
    assert lines[1] == {"event": "fault", "t": 100.0, "step": 3, "recovery": 1, "workers": ["w1"], "cause": "w1: x"}
    assert lines[2] == {"event": "recovery", "recovery": 1, "t": 99.0, "ended_t": 100.0, "step": 3, "from_step": 2,
                        "cause": "w1: x", "replayed": 3, "policy": ""}
    assert lines[3]["metrics"] == {"loss": "inf"}


class LossyWorkers(FakeWorkers):
    """FakeWorkers whose fwd1 reports a loss, not finite from step ``bad_from`` on."""

    def __init__(self, *args: Any, bad_from: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.bad_from = bad_from

    def grant(self, grants: Any) -> None:
        super().grant(grants)
        queued = []
        while not self.events.empty():
            kind, (w, gen, item) = self.events.get_nowait()
            if kind == "done" and item.node == "fwd1":
                item.metrics["loss"] = float("nan") if item.step >= self.bad_from else 1.0 / (1 + item.step)
            queued.append((kind, (w, gen, item)))
        for q in queued:
            self.events.put(q)


def lossy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_nonfinite: str, bad_from: int = 7) -> Harness:
    monkeypatch.setattr(executor_harness, "FakeWorkers", lambda *a, **kw: LossyWorkers(*a, bad_from=bad_from, **kw))
    return Harness(tmp_path, spec=pipeline_spec(steps=12, checkpoint_every=2, on_nonfinite=on_nonfinite))


def test_a_nan_loss_stops_the_job_there_keeps_the_cut_before_it_and_blames_no_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = lossy(tmp_path, monkeypatch, "")
    assert h.x.run() is JobState.FAILED
    end = h.events[-1]
    reason = json.loads(end.detail)["reason"]
    assert end.event == "job.failed"
    assert reason == ("metric 'loss' is nan at step 7 (--on-nonfinite stop): the job stopped there; the last "
                      "committed cut, step 6, is kept: fix the cause and resume from it"), reason
    # The fake workers committed step 8 as they ran ahead (a commit racing in): it was dropped, in etcd.
    commits = read_commits(h.store, h.keys, "pipe")
    assert max(c.step for cs in commits.values() for c in cs) == 6
    assert h.record()["state"] == "failed" and h.record()["cut"] == 6
    assert "job.recovering" not in h.names() and h.x.port.failures == [] and h.x.recovery.records == []
    assert [e.step for e in h.events if e.event == "step.done"] == list(range(7))
    nonfinite = [json.loads(e.detail) for e in h.events if e.event == "job.nonfinite"]
    assert nonfinite == [{"metric": "loss", "value": "nan", "node": "fwd1", "microbatch": 0, "action": "stop"}]
    assert set(h.workers.unloaded) >= {h.worker_of("s0"), h.worker_of("s1")}
    got = read_metrics(run_dir(tmp_path, "pipe", create=False) / METRICS_FILE)
    assert got.steps == list(range(7)) and got.curve("loss")[0] == (0, 1.0)
    assert [(m["event"], m["step"], m["metric"]) for m in got.marks] == [("nonfinite", 7, "loss")]


def test_with_warn_a_nan_loss_is_one_warning_per_metric_and_the_job_runs_to_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = lossy(tmp_path, monkeypatch, "warn")
    assert h.x.run() is JobState.SUCCEEDED
    warnings = [(e.step, json.loads(e.detail)["metric"]) for e in h.events if e.event == "job.nonfinite"]
    assert warnings == [(7, "loss")]
    got = read_metrics(run_dir(tmp_path, "pipe", create=False) / METRICS_FILE)
    assert got.steps == list(range(12)) and all(math.isnan(v) for s, v in got.curve("loss") if s >= 7)
    assert max(c.step for cs in read_commits(h.store, h.keys, "pipe").values() for c in cs) == 12  # the final cut


def test_check_returns_where_a_stop_job_must_stop_and_moves_nothing_itself(tmp_path: Path) -> None:
    """``check`` decides (the first value that is not finite, with ``stop``); the executor carries it out
    through ``stop``: a check that halted the progress or unloaded workers itself would fail here."""
    h = Harness(tmp_path)
    m = h.x.job_metrics
    m.open(None, "stop")
    assert m.check(pb.InstanceDone(node="fwd1", step=3, metrics={"loss": 0.5})) is None
    bad = m.check(pb.InstanceDone(node="fwd1", step=3, metrics={"loss": float("nan"), "acc": float("inf")}))
    assert bad is not None and (bad.metric, bad.step, bad.node) == ("acc", 3, "fwd1")
    assert h.names() == ["job.nonfinite"] and h.x.progress.halted is None and h.workers.unloaded == []
    m.open(None, "warn")
    assert m.check(pb.InstanceDone(node="fwd1", step=4, metrics={"loss": float("nan")})) is None
