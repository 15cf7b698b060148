"""``rallypoint plot JOB``: a run's metric curves as a PNG, and what ``rallypoint run`` adds for it.

The curves come from the run's ``metrics.jsonl`` (``<checkpoint root>/<job>/<run id>/``,
written by the coordinator: :mod:`rallypoint.orchestrator.job.metrics`, docs/metrics.md),
the last value per step, with faults, stalls, recoveries and non-finite values marked at
their steps, the same marks the dashboard draws. The run is found:

* ``--checkpoint-dir DIR``: ``DIR/<job>/LATEST`` (or ``--run``), the checkpoint root the job ran with;
* ``--cluster``: the job's record in etcd names its run directory;
* ``--state-dir`` (default ``.rallypoint``): the checkpoint root of the cluster ``rallypoint up``
  started there (``STATE_DIR/checkpoints``), or the runs of an embedded ``rallypoint run``, kept
  once its cluster was gone (``STATE_DIR/runs/<job>/<run id>/``, :mod:`~rallypoint.client.commands.kept_runs`);
  the newer of the two when both have the job; else the job's record, if that cluster is up.

matplotlib is imported by the command only (Agg: no display), so the other commands start fast.
Also here, for ``rallypoint run`` (``client/commands/main.py``): its ``--on-nonfinite`` option
(:func:`on_nonfinite_option`) and the line it prints for a ``job.nonfinite`` event.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from rallypoint.etcd.records import parsed
from rallypoint.basics.errors import ConfigError, RallypointError
from rallypoint.client.commands.clusters import DEFAULT_STATE_DIR, cluster_options, store_and_keys
from rallypoint.etcd.keys import check_name

if TYPE_CHECKING:
    from rallypoint.orchestrator.api import MetricsRun

F = TypeVar("F", bound=Callable[..., Any])
KEPT_RUNS = "runs"  # STATE_DIR/runs/<job>/<run id>/metrics.jsonl: what an embedded run keeps
METRICS_FILE, LATEST_FILE = "metrics.jsonl", "LATEST"  # as orchestrator/job/metrics.py and runs.py name them
MAX_PANELS = 6
MARK_STYLE = {"fault": ("#d62728", "--"), "stall": ("#b36b00", ":"), "nonfinite": ("#d62728", "-"),
              "resumed": ("#7f7f7f", ":"), "adopted": ("#7f7f7f", ":"), "drain": ("#1f77b4", ":"),
              "spike": ("#9467bd", "-"), "rollback": ("#9467bd", "--")}
REPLAYED = "#2a9d2a"  # the span a recovery replayed: hatched, light


def on_nonfinite_option(f: F) -> F:
    """``rallypoint run --on-nonfinite [stop|warn|rollback]`` (JobSpec.on_nonfinite)."""
    return click.option(
        "--on-nonfinite", type=click.Choice(["stop", "warn", "rollback"]), default=None,
        help="A metric value that is not finite (nan, inf): stop the job at that step (default), keeping the last "
        "committed cut at or before it and no checkpoint past it; warn (a job.nonfinite event per metric) and go "
        "on (docs/metrics.md); or roll back as from a loss spike (--spike-rewind, --spike-skip; docs/integrity.md).")(f)


def describe_nonfinite(d: dict[str, Any]) -> str:
    """The progress line of a ``job.nonfinite`` event."""
    then = {"stop": "the job stops there", "rollback": "the job rolls back"}.get(d.get("action"), "the job goes on")
    return (f"[red]non-finite[/red] metric {d.get('metric')!r} is {d.get('value')} at step {d.get('step')} "
            f"(node {d.get('node')}): {then} (--on-nonfinite {d.get('action')})")


# -- finding the run -----------------------------------------------------------------------------


@dataclass(frozen=True)
class FoundRun:
    job: str
    run: str
    path: Path  # its metrics.jsonl (it may not exist yet)


def _under_root(root: Path, job: str, run: str) -> FoundRun | None:
    """The run ``run`` (or the one LATEST names) of ``job`` under a checkpoint root; None: the job has none there."""
    from rallypoint.orchestrator.api import check_run_id

    base = root / job
    if not run:
        latest = base / LATEST_FILE
        if not latest.is_file():
            return None
        run = check_run_id(latest.read_text().strip(), f"{latest} names")
    if not (base / run).is_dir():
        return None
    return FoundRun(job, run, base / run / METRICS_FILE)


def _from_record(state_dir: Path, cluster: str | None, job: str, run: str) -> FoundRun | None:
    """The run directory the job's etcd record names (the current run; ``run``: an earlier one kept in etcd)."""
    from rallypoint.orchestrator.api import RUN_ID, old_runs, run_of

    store, keys = store_and_keys(state_dir, cluster)
    try:
        kv = store.get(keys.job(job))
        records = [r] if (r := parsed(kv, "job")) is not None else []
        records += old_runs(store, keys, job) if run else []
    finally:
        store.close()
    for r in records:
        rd = Path(str(r.get("run_dir") or ""))
        # A path read from etcd: only <...>/<job>/<run id>, absolute, without '..', is read.
        if (r.get("run_dir") and (not run or run_of(r) == run) and rd.is_absolute() and ".." not in rd.parts
                and rd.parent.name == job and RUN_ID.match(rd.name)):
            return FoundRun(job, rd.name, rd / METRICS_FILE)
    return None


def find_run(job: str, *, run: str = "", checkpoint_dir: Path | None = None, state_dir: Path = Path(DEFAULT_STATE_DIR),
             cluster: str | None = None) -> FoundRun:
    """The run of ``job`` to plot (see the module doc). Raises ConfigError naming where it looked."""
    from rallypoint.orchestrator.api import check_run_id

    check_name("job", job)
    if run:
        check_run_id(run)
    which = f"run {run}" if run else "run"
    if checkpoint_dir is not None:
        found = _under_root(checkpoint_dir, job, run)
        if found is None:
            raise ConfigError(f"no {which} of job {job!r} under the checkpoint root {checkpoint_dir}: "
                              "check the job name and give the --checkpoint-dir the job ran with")
        return found
    if cluster:
        found = _from_record(state_dir, cluster, job, run)
        if found is None:
            raise ConfigError(f"cluster {cluster} has no {which} of job {job!r} with a run directory: check "
                              "the job name (`rallypoint jobs` lists them); a job run without checkpoints keeps no "
                              "metrics")
        return found
    looked = [state_dir / "checkpoints", state_dir / KEPT_RUNS]
    candidates = [f for root in looked if (f := _under_root(root, job, run)) is not None]
    if candidates:
        return max(candidates, key=lambda f: f.path.stat().st_mtime if f.path.exists() else 0.0)
    try:
        found = _from_record(state_dir, None, job, run)
    except RallypointError:  # no cluster recorded there, or it is down: the files were the way
        found = None
    if found is None:
        raise ConfigError(f"no {which} of job {job!r} in {looked[0]} or {looked[1]}: check the job name; give "
                          "--checkpoint-dir (the checkpoint root it ran with), --state-dir (where `rallypoint up` or "
                          "`rallypoint run` kept it) or --cluster")
    return found


# -- what is drawn ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlotData:
    """The curves to draw (metric -> steps, values), the marks, and the one-line summary; ``smoothed``: each
    curve's EMA (``--smooth``; drawn over the raw curve, which is kept faint); ``sparse``: the metrics that exist
    only at some steps (an eval every k steps: drawn as points joined); ``log_y``: the panels drawn on a log
    scale (``--log-y``: those whose values are all positive)."""

    curves: dict[str, tuple[list[int], list[float]]]
    marks: list[dict[str, Any]]
    summary: str
    smoothed: dict[str, list[float]] = field(default_factory=dict)
    sparse: frozenset[str] = frozenset()
    log_y: frozenset[str] = frozenset()


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average of weight ``weight`` (0: none; 0.6 is its
    default), debiased at the start; a value that is not finite is kept as it is and does not enter the average."""
    out: list[float] = []
    last, n = 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last, n = last * weight + (1 - weight) * v, n + 1
        out.append(last / (1 - weight ** n) if weight else last)
    return out


def plot_data(data: MetricsRun, *, job: str, run: str, metric: str | None = None, smoothing: float = 0.0,
              log_y: bool = False) -> PlotData:
    """What ``rallypoint plot`` draws of ``data``: every metric (or ``metric``), the last value per step;
    raises ConfigError when there is nothing to draw, ``metric`` is not one of the run's, or ``smoothing``
    is not in [0, 1)."""
    if not 0 <= smoothing < 1:
        raise ConfigError(f"--smooth {smoothing} is not in [0, 1): give a weight such as 0.6 (0: no smoothing)")
    if not data.names:
        raise ConfigError(f"run {run} of job {job!r} has no completed step with metrics yet: wait for its first "
                          "step (a job that declares no metric, prog.metric(...), has no curve)")
    if metric is not None and metric not in data.values:
        raise ConfigError(f"run {run} of job {job!r} has no metric {metric!r}; its metrics are "
                          f"{', '.join(data.names)}: pass one of them to --metric")
    names = [metric] if metric else sorted(data.names, key=lambda n: (n != "loss", n))
    curves = {n: ([s for s, _ in data.curve(n)], [v for _, v in data.curve(n)]) for n in names}
    main = names[0]
    steps, values = curves[main]
    marks = data.plot_marks()
    recoveries = sum(m["kind"] == "recovery" for m in marks) or sum(m["kind"] == "fault" for m in marks)
    nonfinite = [m["label"] for m in marks if m["kind"] == "nonfinite"]
    rollbacks = sum(m["kind"] == "rollback" for m in marks)
    summary = (f"{len(data.steps)} steps ({steps[0]}..{steps[-1]}), {main} {values[0]:.6g} -> {values[-1]:.6g}, "
               f"{recoveries} {'recovery' if recoveries == 1 else 'recoveries'}"
               + (f", {rollbacks} {'rollback' if rollbacks == 1 else 'rollbacks'}" if rollbacks else "")
               + (f", non-finite: {'; '.join(nonfinite)}" if nonfinite else ""))
    sparse = frozenset(n for n in names if len(curves[n][0]) < len(data.steps))
    smoothed = {n: smooth(curves[n][1], smoothing) for n in names if smoothing and n not in sparse}
    logs = frozenset(n for n in names if log_y and all(v > 0 for v in curves[n][1] if math.isfinite(v)))
    if log_y and len(logs) < len(names):
        summary += f"; linear y for {', '.join(sorted(set(names) - logs))} (values <= 0)"
    return PlotData(curves, marks, summary, smoothed, sparse, logs)


def figure(pd: PlotData, title: str) -> Any:
    """The matplotlib figure of ``pd`` (Agg; the caller closes it). Each panel: the curve (faint under its
    smoothed line with ``--smooth``; points joined for a metric only some steps have), a loss as a line at the
    step it happened ("lost w2"), the span a recovery replayed (from the cut it restored to that step) hatched
    and labelled "replayed from S, MTTR x s" inside it, below the loss's label."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = list(pd.curves)[:MAX_PANELS]
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.8 * len(names) + 0.6), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        steps, values = pd.curves[name]
        shown = [v if math.isfinite(v) else math.nan for v in values]
        style: dict[str, Any] = {"marker": "o", "ms": 3} if name in pd.sparse else {}
        if name in pd.smoothed:
            ax.plot(steps, shown, lw=1.0, alpha=0.3, color="C0", gid=f"raw:{name}")
            ax.plot(steps, [v if math.isfinite(v) else math.nan for v in pd.smoothed[name]], lw=1.6, color="C0",
                    label=name, gid=f"curve:{name}")
        else:
            ax.plot(steps, shown, lw=1.4, color="C0", label=name, gid=f"curve:{name}", **style)
        if name in pd.log_y:
            ax.set_yscale("log")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        for m in pd.marks:
            if m["kind"] == "recovery":
                end = max(m["step"], m["from_step"] + 0.5)
                ax.axvspan(m["from_step"], end, facecolor=REPLAYED, alpha=0.12, hatch="///", edgecolor=REPLAYED,
                           lw=0, gid=f"replayed:{m['from_step']}-{m['step']}")
                ax.text(m["from_step"], 0.06, f" {m['label']}", transform=ax.get_xaxis_transform(), va="bottom",
                        fontsize=8, color="#1e6e1e", gid="replayed-label")
            else:
                colour, ls = MARK_STYLE.get(m["kind"], ("#7f7f7f", ":"))
                ax.axvline(m["step"], color=colour, ls=ls, lw=1.2, gid=f"{m['kind']}:{m['step']}")
                ax.text(m["step"], 0.97, f" {m['label']}", transform=ax.get_xaxis_transform(), va="top",
                        fontsize=8, color=colour, gid=f"{m['kind']}-label")
    axes[0, 0].set_title(title)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    return fig


def draw(pd: PlotData, out: Path, title: str) -> None:
    """The PNG of ``pd`` at ``out`` (matplotlib, Agg)."""
    from matplotlib import pyplot as plt

    fig = figure(pd, title)
    try:
        fig.savefig(out, format="png", dpi=100)
    finally:
        plt.close(fig)


@click.command()
@cluster_options
@click.argument("job")
@click.option("--metric", default=None, help="Only this metric (default: every metric of the run, loss first).")
@click.option("--run", "run_id", default="", help="An earlier run of JOB (default: its newest, LATEST).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The checkpoint root the job ran with (instead of finding it through --state-dir or --cluster).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the PNG (default: JOB-RUN.png in the current directory).")
@click.option("--smooth", "smoothing", type=float, default=0.0, metavar="W",
              help="Smooth each curve as TensorBoard does (an EMA of weight W in [0, 1), e.g. 0.6), the raw curve "
              "kept faint.")
@click.option("--log-y", is_flag=True, help="A log scale for the values (panels whose values are all positive).")
def plot(state_dir: Path, cluster: str | None, job: str, metric: str | None, run_id: str,
         checkpoint_dir: Path | None, out: Path | None, smoothing: float = 0.0, log_y: bool = False) -> None:
    """Draw JOB's loss curve (every metric, or --metric) as a PNG, losses, replayed spans and MTTRs marked.

    From the run's metrics.jsonl (docs/metrics.md): on a running cluster (--state-dir, --cluster),
    or after `rallypoint run` on its embedded cluster has ended (it keeps the run's metrics under
    .rallypoint/runs), or from --checkpoint-dir."""
    from rallypoint.orchestrator.api import read_metrics

    found = find_run(job, run=run_id, checkpoint_dir=checkpoint_dir, state_dir=state_dir, cluster=cluster)
    if not found.path.is_file():
        raise ConfigError(f"run {found.run} of job {job!r} has no {METRICS_FILE} yet ({found.path}): no step has "
                          "completed, or it ran before metrics were kept; wait for its first step")
    pd = plot_data(read_metrics(found.path), job=job, run=found.run, metric=metric, smoothing=smoothing,
                   log_y=log_y)
    out = out or Path(f"{job}-{found.run}.png")
    draw(pd, out, f"{job} ({found.run})")
    click.echo(f"{out}: {pd.summary}")
