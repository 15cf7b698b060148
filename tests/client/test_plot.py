"""`rallypoint plot`'s pure parts: what it draws of a metrics.jsonl, where it finds the run, the PNG, and
`rallypoint run --on-nonfinite`. (As a subprocess on real runs: tests/integration/test_nonfinite.py, and after
an embedded `rallypoint run`: tests/integration/test_recovery.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rallypoint.basics.errors import ConfigError
from rallypoint.client.commands.main import main
from rallypoint.client.commands.output import describe_event
from rallypoint.client.commands.plot import draw, figure, find_run, plot_data, smooth
from rallypoint.orchestrator.job.metrics import parse_metrics
from tests.helpers.cli import ROOT

RUN = "run-20260101T000000-abcdef"
LINES = [
    {"step": 0, "t": 1.0, "metrics": {"loss": 3.0, "acc": 0.1}},
    {"step": 1, "t": 2.0, "metrics": {"loss": 2.0, "acc": 0.2}},
    {"step": 2, "t": 3.0, "metrics": {"loss": 1.5, "acc": 0.3}},
    {"event": "fault", "t": 3.5, "step": 3, "recovery": 1, "workers": ["w2"], "cause": "w2: event stream ended"},
    {"event": "recovery", "recovery": 1, "t": 3.5, "ended_t": 4.0, "step": 3, "from_step": 2, "cause": "w2",
     "replayed": 2},
    {"step": 2, "t": 4.5, "metrics": {"loss": 1.25, "acc": 0.3}},  # step 2 again after the recovery
    {"step": 3, "t": 5.0, "metrics": {"loss": 1.0, "acc": 0.4}},
    {"event": "nonfinite", "t": 5.5, "step": 4, "metric": "loss", "value": "nan", "action": "stop"},
]


def write_run(root: Path, job: str = "j", run: str = RUN, lines: list[dict] = LINES) -> Path:
    rd = root / job / run
    rd.mkdir(parents=True)
    (root / job / "LATEST").write_text(run + "\n")
    (rd / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return rd / "metrics.jsonl"


def test_the_plot_takes_the_last_value_per_step_loss_first_and_marks_recoveries_and_nonfinite_steps() -> None:
    data = parse_metrics(json.dumps(x) for x in LINES)
    pd = plot_data(data, job="j", run=RUN)
    assert list(pd.curves) == ["loss", "acc"]
    assert pd.curves["loss"] == ([0, 1, 2, 3], [3.0, 2.0, 1.25, 1.0])
    assert pd.marks == [{"kind": "fault", "step": 3, "label": "lost w2"},
                        {"kind": "recovery", "step": 3, "from_step": 2, "recovery": 1, "mttr_s": None,
                         "label": "replayed from 2"},
                        {"kind": "nonfinite", "step": 4, "label": "loss nan"}]
    assert pd.summary == "4 steps (0..3), loss 3 -> 1, 1 recovery, non-finite: loss nan"
    only = plot_data(data, job="j", run=RUN, metric="acc")
    assert list(only.curves) == ["acc"] and only.summary.startswith("4 steps (0..3), acc 0.1 -> 0.4")
    with pytest.raises(ConfigError, match="run .* of job 'j' has no metric 'lr'; its metrics are acc, loss: pass one"):
        plot_data(data, job="j", run=RUN, metric="lr")
    with pytest.raises(ConfigError, match="no completed step with metrics yet"):
        plot_data(parse_metrics([]), job="j", run=RUN)


def test_the_run_is_found_under_a_checkpoint_root_or_the_state_dir_the_newest_first(tmp_path: Path) -> None:
    path = write_run(tmp_path / "ck")
    assert find_run("j", checkpoint_dir=tmp_path / "ck").path == path
    with pytest.raises(ConfigError, match="no run of job 'k' under the checkpoint root"):
        find_run("k", checkpoint_dir=tmp_path / "ck")
    with pytest.raises(ConfigError, match="is not a run id"):
        find_run("j", run="../../etc", checkpoint_dir=tmp_path / "ck")
    with pytest.raises(ConfigError):
        find_run("../j", checkpoint_dir=tmp_path / "ck")
    state = tmp_path / "state"
    kept = write_run(state / "runs")  # where an embedded `rallypoint run` keeps its runs
    assert find_run("j", state_dir=state).path == kept
    newer = write_run(state / "checkpoints", run="run-20260102T000000-abcdef")  # a `rallypoint up` cluster's run
    assert find_run("j", state_dir=state).path == newer
    with pytest.raises(ConfigError, match=r"no run of job 'x' in .*checkpoints or .*runs: check the job name"):
        find_run("x", state_dir=state)


def test_draw_writes_a_png_matplotlib_reads_back(tmp_path: Path) -> None:
    from matplotlib import image

    data = parse_metrics(json.dumps(x) for x in LINES)
    out = tmp_path / "p.png"
    draw(plot_data(data, job="j", run=RUN), out, "j")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    h, w = image.imread(out).shape[:2]
    assert w == 1000 and h > 400


def test_the_plot_command_writes_the_png_and_one_line_or_says_what_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_run(tmp_path / "ck")
    (tmp_path / "ck" / "empty" / RUN).mkdir(parents=True)
    (tmp_path / "ck" / "empty" / "LATEST").write_text(RUN)
    runner = CliRunner()
    monkeypatch.chdir(tmp_path)  # the PNG goes to the current directory by default
    r = runner.invoke(main, ["plot", "j", "--checkpoint-dir", str(tmp_path / "ck")])
    assert r.exit_code == 0, r.output
    assert r.output == f"j-{RUN}.png: 4 steps (0..3), loss 3 -> 1, 1 recovery, non-finite: loss nan\n"
    assert (tmp_path / f"j-{RUN}.png").read_bytes()[:4] == b"\x89PNG"
    r = runner.invoke(main, ["plot", "empty", "--checkpoint-dir", str(tmp_path / "ck")])
    assert r.exit_code == 1 and "has no metrics.jsonl yet" in r.output and "wait for its first step" in r.output


def test_on_nonfinite_is_a_choice_of_rallypoint_run_and_reaches_the_job_spec() -> None:
    from rallypoint.client.compile import compile_program
    from rallypoint.client.jobspec import job_spec
    from tests.examples import example

    r = CliRunner().invoke(main, ["run", "--reference", "--on-nonfinite", "ignore", str(ROOT / "examples" / "x.py")])
    assert r.exit_code == 2 and "'ignore' is not one of 'stop', 'warn', 'rollback'" in r.output, r.output
    assert "--on-nonfinite [stop|warn|rollback]" in CliRunner().invoke(main, ["run", "--help"]).output
    spec = job_spec(compile_program(example("rl_loop").build(steps=2)), on_nonfinite="warn")
    assert spec.on_nonfinite == "warn"
    line = describe_event({"event": "job.nonfinite", "step": 7, "metric": "loss", "value": "nan", "node": "train",
                      "action": "warn"})
    assert line == ("[red]non-finite[/red] metric 'loss' is nan at step 7 (node train): the job goes on "
                    "(--on-nonfinite warn)")


KILLED = ([{"step": s, "t": float(s), "metrics": {"loss": 4.0 / (s + 1)}} for s in range(17)]
          + [{"event": "fault", "t": 17.0, "step": 17, "recovery": 1, "workers": ["w2"], "cause": "w2: killed"},
             {"event": "recovery", "recovery": 1, "t": 17.0, "ended_t": 18.0, "step": 17, "from_step": 10,
              "cause": "w2", "replayed": 7}]
          + [{"step": s, "t": 18.0 + s, "metrics": {"loss": 4.0 / (s + 1)}} for s in range(10, 17)]
          + [{"event": "replayed", "recovery": 1, "t": 35.0, "step": 17, "from_step": 10, "mttr_s": 1.5}]
          + [{"step": s, "t": 36.0 + s, "metrics": {"loss": 4.0 / (s + 1), **({"eval_loss": 5.0 / (s + 1)}
                                                                              if s % 5 == 0 else {})}}
             for s in range(17, 25)])


def test_a_kill_reads_as_a_loss_at_its_step_then_a_replayed_span_with_its_mttr_and_smoothing_keeps_the_raw_curve(
        ) -> None:
    """A kill at step 17 restored from step 10: a red line at 17 "lost w2"; 10..17 hatched, "replayed from 10,
    MTTR 1.50 s" inside the span, below the loss's label; --smooth, --log-y, an eval metric as points."""
    from matplotlib import pyplot as plt

    pd = plot_data(parse_metrics(json.dumps(x) for x in KILLED), job="j", run=RUN, smoothing=0.6, log_y=True)
    assert pd.sparse == {"eval_loss"} and pd.curves["eval_loss"][0] == [20] and pd.log_y == {"loss", "eval_loss"}
    fig = figure(pd, "j")
    try:
        ax = fig.axes[0]
        by_gid = {a.get_gid(): a for a in [*ax.lines, *ax.patches, *ax.texts] if a.get_gid()}
        lost = by_gid["fault:17"]
        assert list(lost.get_xdata()) == [17, 17] and lost.get_color() == "#d62728"
        assert by_gid["fault-label"].get_text() == " lost w2" and by_gid["fault-label"].get_position()[0] == 17
        span = by_gid["replayed:10-17"]
        xs = ([span.get_x(), span.get_x() + span.get_width()] if hasattr(span, "get_width")  # matplotlib >= 3.9
              else [x for x, _ in span.get_xy()])
        assert (min(xs), max(xs)) == (10, 17) and span.get_hatch() == "///"
        label = by_gid["replayed-label"]
        assert label.get_text() == " replayed from 10, MTTR 1.50 s" and label.get_position()[0] == 10
        assert label.get_position()[1] < by_gid["fault-label"].get_position()[1]  # under the loss's label
        raw, smoothed = by_gid["raw:loss"], by_gid["curve:loss"]
        assert raw.get_alpha() == 0.3 and list(smoothed.get_ydata()) == pytest.approx(pd.smoothed["loss"])
        assert ax.get_yscale() == "log"
        assert fig.axes[1].lines[0].get_marker() == "o"  # eval: the steps it exists at, as points
    finally:
        plt.close(fig)
    assert smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, 1.75 / 0.75])  # debiased: (0.5*0.5 + 0.5*3) / (1 - 0.5**2)
    assert smooth([2.0, float("inf"), 2.0], 0.9)[::2] == pytest.approx([2.0, 2.0])
    with pytest.raises(ConfigError, match=r"--smooth 1.0 is not in \[0, 1\)"):
        plot_data(parse_metrics(json.dumps(x) for x in KILLED), job="j", run=RUN, smoothing=1.0)
