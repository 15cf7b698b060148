"""Trackers (orchestrator/job/sinks.py): TensorBoard event files written beside metrics.jsonl, read back with
TensorBoard's own reader; a new leader goes on in the same directory writing each step once; a failing sink
never fails the job; W&B offline where wandb is installed. Pure: no process, no cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from rallypoint.client.commands.main import main
from rallypoint.orchestrator.job import tfevents
from rallypoint.orchestrator.job.metrics import METRICS_FILE, JobMetrics
from rallypoint.orchestrator.job.sinks import EVENTS_TAG, Sinks, TensorBoardSink
from rallypoint.proto import rallypoint_pb2 as pb

RUN = "run-20260101T000000-abcdef"


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))

    error = info = warning


class _Recovery:  # what JobMetrics.replayed reads of a RecoveryRecord
    number, checkpoint_step = 1, 2

    def to_json(self) -> dict[str, Any]:
        return {"recovery": 1, "mttr_s": 1.25}


def _step(m: JobMetrics, s: int) -> None:
    m.observe(pb.JobEvent(job="j", event="step.done", step=s, metrics={"loss": 10.0 - s, "acc": s / 10}))


def _accumulator(d: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_files_hold_every_step_once_and_the_recovery_marks_across_a_new_leader(tmp_path: Path) -> None:
    spec = pb.JobSpec(job="j", metrics_sinks=[pb.MetricsSink(kind="tensorboard", dir=str(tmp_path / "tb"))])
    run_dir = tmp_path / "ck" / "j" / RUN
    run_dir.mkdir(parents=True)
    clock = [100.0]
    m = JobMetrics(spec, log=_Log(), event=lambda *a, **k: None, wall=lambda: clock[0])
    m.open(run_dir, "stop")
    for s in range(5):
        _step(m, s)
    m.observe(pb.JobEvent(job="j", event="job.recovering", step=5, detail=json.dumps(
        {"recovery": 1, "lost": {"w2": "event stream ended"}})))
    m.observe(pb.JobEvent(job="j", event="job.recovered", step=2, detail=json.dumps(
        {"recovery": 1, "detected_at": 99.5, "checkpoint_step": 2, "reasons": {"w2": "lost"}})))
    for s in (2, 3, 4):  # replayed: the same values again, not written twice
        _step(m, s)
    m.replayed(_Recovery())
    for s in (5, 6, 7):
        _step(m, s)
    # The leader dies here (no job.finished); a new leader adopts the run and goes on in the same directory.
    clock[0] = 200.0
    m2 = JobMetrics(spec, log=_Log(), event=lambda *a, **k: None, wall=lambda: clock[0])
    m2.open(run_dir, "stop")
    m2.observe(pb.JobEvent(job="j", event="job.adopted", step=6))
    for s in (6, 7, 8, 9):
        _step(m2, s)
        if s == 8:
            m2.observe(pb.JobEvent(job="j", event="job.drained", step=9, detail=json.dumps(
                {"drain": 1, "worker": "w1", "reason": "rallypoint drain", "paused_s": 0.5})))
    m2.observe(pb.JobEvent(job="j", event="job.finished", step=10))

    board = tmp_path / "tb" / "j" / RUN
    assert len(list(board.glob("events.out.tfevents.*"))) == 2  # one file per leader, in one run directory
    acc = _accumulator(board)
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == list(range(10))  # every step once
    assert [e.value for e in loss] == [10.0 - s for s in range(10)]
    assert [(e.step, e.value) for e in acc.Scalars("rallypoint/lost_workers")] == [(5, 1.0)]
    assert [(e.step, e.value) for e in acc.Scalars("rallypoint/recovery_mttr_s")] == [(5, 1.25)]
    assert [(e.step, e.value) for e in acc.Scalars("rallypoint/drains")] == [(9, 1.0)]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(EVENTS_TAG)]
    assert texts[0][0] == 5 and texts[0][1].startswith("step 5: lost w2")
    assert (5, "step 5: recovery 1 replayed from step 2, MTTR 1.25 s") in texts
    assert any(t.endswith("adopted") for _, t in texts) and (9, "step 9: drained w1 (rallypoint drain)") in texts
    marks = [json.loads(x) for x in (run_dir / METRICS_FILE).read_text().splitlines() if '"event"' in x]
    assert {"event": "replayed", "recovery": 1, "t": 100.0, "step": 5, "from_step": 2, "mttr_s": 1.25} in marks


def test_a_record_cut_short_ends_the_reading_and_a_failing_sink_is_dropped_without_failing_the_job(
        tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path / "tb", wall=lambda: 5.0)
    sink.metrics(0, {"loss": 1.0})
    sink.metrics(1, {"loss": 0.5})
    sink.close()
    (f,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    f.write_bytes(f.read_bytes()[:-3])  # the writer died mid-record
    assert [e.step for e in tfevents.read_events(f)] == [0, 0]  # the file version, step 0; step 1 is cut short
    assert TensorBoardSink(tmp_path / "tb").written_through == 0  # step 1 is written again by the next writer

    class Broken:
        def metrics(self, *a: Any, **k: Any) -> None:
            raise OSError("disk full")

        def event(self, *a: Any, **k: Any) -> None:
            raise AssertionError("dropped after its first failure")

        def close(self) -> None:
            pass

    log = _Log()
    sinks = Sinks([("broken", Broken())], log)
    sinks.metrics(0, {"loss": 1.0}, 1.0)
    sinks.event(0, "stall", {}, 1.0)
    assert [e for e, _ in log.lines] == ["job.metrics_sink_failed"] and sinks.sinks == []


def test_a_tensorboard_directory_that_cannot_be_written_is_one_line_and_exit_1(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    r = CliRunner().invoke(main, ["run", str(tmp_path / "job.py"), "--tensorboard", str(tmp_path / "file" / "tb")])
    assert r.exit_code == 1, r.output
    line = r.output.strip()
    assert "\n" not in line and f"--tensorboard {tmp_path / 'file' / 'tb'}: cannot write there" in line
    assert "give a directory you can write" in line


def test_wandb_offline_writes_its_run_under_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not run where wandb is not installed (it is no dependency): the sink is written against its documented API."""
    pytest.importorskip("wandb", reason="wandb is not installed here: the W&B sink is written against its API only")
    from rallypoint.orchestrator.job.sinks import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    sink = WandbSink(tmp_path / "wb", job="j", run=RUN)
    for s in (0, 1, 1, 2):  # step 1 again (replayed): logged once
        sink.metrics(s, {"loss": 1.0 / (s + 1)})
    sink.event(3, "fault", {"workers": ["w2"], "cause": "lost"})
    sink.close()
    assert sink.written_through == 3
    assert list((tmp_path / "wb").rglob("*.wandb")), "the offline run's file is under the directory"
    again = WandbSink(tmp_path / "wb", job="j", run=RUN)  # a new leader: goes on after step 3
    again.metrics(2, {"loss": 0.0})
    again.metrics(4, {"loss": 0.2})
    again.close()
    assert again.written_through == 4 and len(list((tmp_path / "wb").rglob("*.wandb"))) == 2
