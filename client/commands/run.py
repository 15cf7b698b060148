"""``rallypoint run``: a job file on an embedded local cluster, on ``--cluster``, or ``--reference``.

Added to the ``rallypoint`` group by :mod:`rallypoint.client.commands.main`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from rallypoint.basics.errors import ConfigError
from rallypoint.basics.logs import configure as configure_logs, library_logs_to
from rallypoint.client.commands import plot as plot_cli
from rallypoint.client.commands.kept_runs import EmbeddedRuns, runs_root, settle
from rallypoint.client.commands.output import describe_event, stops
from rallypoint.client.commands.integrity import check_spikes, spike_options
from rallypoint.recovery.skips import Skips
from rallypoint.client.commands.clusters import DEFAULT_STATE_DIR, export_platforms_for, insecure, resolve_cluster, tls_options

# -- running jobs ---------------------------------------------------------------------------

HOST_DEVICES = 8  # JAX CPU devices of the client process (set before the job file runs JAX)


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--steps", type=int, default=None, help="Override the program's step count.")
@click.option("--reference", is_flag=True, help="Run in this process, no cluster: the bitwise reference.")
@click.option("--cluster", "cluster", default=None, metavar="[NAME@]HOST:PORT[,...]",
              help="Run on this cluster (etcd endpoints) instead of an embedded one.")
@tls_options
@click.option("--workers", type=int, default=None, help="Embedded cluster: workers (default: one per slice).")
@click.option("--spares", type=int, default=1, show_default=True, help="Embedded cluster: spare workers.")
@click.option("--devices-per-worker", type=int, default=None,
              help="Embedded cluster: devices per worker (default: the largest slice).")
@click.option("--window", type=int, default=0, show_default=True,
              help="Steps in flight (0: the leader decides from the checkpoint interval and the output log's limit).")
@click.option("--platform", "platforms", default=None, metavar="P[,P...]",
              help="Export the job's programs for these platforms (cpu, cuda, rocm, tpu). Default: with --cluster, "
              "the platforms of the pool's workers; on an embedded cluster, cpu; with --reference, this process's. "
              "On an embedded cluster, one platform: its workers run on it (cuda, rocm: the host's GPUs).")
@click.option("--json", "as_json", is_flag=True, help="One JSON event per line instead of a progress bar.")
@click.option("--fail", "fail", multiple=True, metavar="ACTION:NAME@STEP",
              help="Once the job reaches STEP, act on the worker holding slice or node NAME (repeatable): kill "
              "(SIGKILL), preempt (SIGTERM, a preemption notice) or drain (as `rallypoint drain`). Embedded cluster "
              "only: corrupt (that worker flips one bit of the slice's state at every update from STEP on, silently) "
              "or corrupt-once (at STEP only); the final digest is then compared with the in-process reference's.")
@click.option("--policy", type=click.Choice(["partial", "restart-all"]), default=None,
              help="Recovery policy (default partial: only the affected nodes re-run).")
@click.option("--checkpoint-every", type=int, default=None, help="Checkpoint every K steps (default: the program's).")
@click.option("--keep-checkpoints", type=int, default=None,
              help="Committed checkpoints kept per slice besides the cut (default 3).")
@click.option("--on-no-spare", type=click.Choice(["wait", "fail", "shrink"]), default=None,
              help="No spare for a lost slice: wait for one (default), fail the job, or shrink (a slice declared "
              "devices=(min, max) restores onto fewer devices and grows back later).")
@click.option("--priority", type=int, default=None,
              help="Higher first: with no free devices, slices of lower-priority jobs yield to this one (default 0).")
@click.option("--wait-timeout-s", type=float, default=None, help="How long --on-no-spare wait waits (default 60).")
@click.option("--stall-timeout-s", type=float, default=None,
              help="No progress this long: job.stalled and a recovery of the workers it waits on (default 60).")
@click.option("--max-faults", type=int, default=None,
              help="Failure policy: recoveries from faults (lost, hung, stalled workers) allowed in any "
              "--failure-window-s; one more fails the job, listing them (default 10).")
@click.option("--max-preemptions", type=int, default=None,
              help="Failure policy: recoveries from preempted workers allowed in any --failure-window-s (default 30).")
@click.option("--failure-window-s", type=float, default=None,
              help="Failure policy: the sliding window of --max-faults, --max-preemptions and of the stall count "
              "(default 3600).")
@click.option("--compile-timeout-s", type=float, default=None,
              help="While the nodes the job waits on compile (their first call), no stall before this long "
              "(default 1800).")
@click.option("--stragglers", type=click.Choice(["migrate", "report", "off"]), default=None,
              help="A slice persistently slower than its baseline and its peers: move it to a spare by a drain "
              "(migrate, default), only report it (job.straggler events), or judge nothing (off).")
@click.option("--straggler-factor", type=float, default=None,
              help="How many times slower than its baseline and its peers a slice must be to straggle (default 2).")
@click.option("--warm-spares", type=int, default=None,
              help="Spares that compile the job's programs before any loss, so a recovery onto one pays no "
              "compilation (default 2; 0: off).")
@plot_cli.on_nonfinite_option
@spike_options
@click.option("--new-run", is_flag=True,
              help="The job name already has a run with checkpoints: start a new run anyway (the old run's files "
              "and commits stay under its run id, `rallypoint status NAME`). Without it such a run is refused; "
              "`rallypoint resume NAME` continues the old run.")
@click.option("--detach", is_flag=True, help="With --cluster: return once the job runs, printing its name and run "
              "id; `rallypoint watch NAME` follows it, `rallypoint logs NAME` prints its events.")
@click.option("--tensorboard", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="Also write the job's metrics and its faults and recoveries as TensorBoard event files under "
              "DIR/JOB/RUN (written by the leading coordinator; `tensorboard --logdir DIR`; docs/metrics.md).")
@click.option("--wandb", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="Also log them to a W&B run in offline mode under DIR/JOB/RUN (where wandb is installed on the "
              "coordinators; `wandb sync` uploads it).")
@click.option("--set", "settings", multiple=True, metavar="NAME=VALUE",
              help="A setting of the job: what rallypoint.client.setting(NAME) returns in the job file, "
              "here and on the workers, shipped with the job's code (docs/data.md, \"Job settings\").")
@click.option("--code", "code_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The directory shipped to the workers as the job's code (host sources run from it; default: the "
              "job file's directory). Limited in size; .rallypointignore leaves files out (docs/data.md).")
@click.option("--rm", "remove_run", is_flag=True,
              help="Embedded cluster: delete the run's directory (checkpoints, metrics, events, code) once the job "
              "succeeded. By default it is kept under STATE_DIR/runs/JOB/RUN (`rallypoint export`, `rallypoint plot`).")
@click.option("--keep-runs", type=click.IntRange(min=0), default=0, show_default=True,
              help="Embedded cluster: keep this many runs of the job name under STATE_DIR/runs, deleting older ones "
              "once this one succeeded (0: keep all), as a cluster's coordinators do.")
def run(job_file: Path, steps: int | None, reference: bool, cluster: str | None, workers: int | None, spares: int,
        devices_per_worker: int | None, window: int, platforms: str | None, as_json: bool, fail: tuple[str, ...], policy: str | None,
        checkpoint_every: int | None, keep_checkpoints: int | None, on_no_spare: str | None,
        wait_timeout_s: float | None, stall_timeout_s: float | None, priority: int | None, stragglers: str | None,
        straggler_factor: float | None, warm_spares: int | None, max_faults: int | None, on_nonfinite: str | None,
        max_preemptions: int | None, failure_window_s: float | None, compile_timeout_s: float | None, new_run: bool,
        detach: bool, code_dir: Path | None, remove_run: bool, keep_runs: int, tensorboard: Path | None = None,
        wandb: Path | None = None, settings: tuple[str, ...] = (), spikes: dict[str, Any] | None = None,
        skips: Skips = Skips()) -> None:
    """Run the program built by JOB_FILE: on an embedded local cluster (default), on --cluster, or --reference."""
    from rallypoint.client.compile import compile_program, ensure_host_devices

    ensure_host_devices(HOST_DEVICES)
    from rallypoint.client.commands.faults import parse_faults
    from rallypoint.client.jobfile import load_program
    from rallypoint.client.reference import ReferenceExecutor

    if detach and not cluster:
        raise ConfigError("--detach needs --cluster: an embedded cluster stops with this command, and the job with it "
                          "(`rallypoint up` starts a cluster that stays)")
    if detach and fail:
        raise ConfigError("--fail acts as the job runs, from this command: it cannot be used with --detach")
    from rallypoint.basics.settings import parse_assignments
    from rallypoint.client.jobspec import writable_dir

    for option, where in (("--tensorboard", tensorboard), ("--wandb", wandb)):
        if where is not None:
            writable_dir(where, option)  # before anything runs: a directory that cannot be written is refused

    try:
        given = parse_assignments(settings)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if reference and wandb is not None:
        raise ConfigError("--wandb is written by the cluster's coordinator: --reference writes none "
                          "(use --tensorboard)")
    program = load_program(job_file, steps=steps, settings=given)
    if reference and (cluster or workers is not None or devices_per_worker is not None or fail or new_run
                      or remove_run or keep_runs):
        raise ConfigError("--reference runs in this process: it takes no --cluster, --workers, --devices-per-worker, "
                          "--fail, --new-run, --rm or --keep-runs")
    if skips and not reference:
        raise ConfigError("--skip is for --reference: a cluster run's skips come from its rollbacks (--on-spike)")
    spikes = spikes or {}
    check_spikes(spikes, checkpoint_every=checkpoint_every or program.checkpoint_every,
                 keep_checkpoints=keep_checkpoints, on_nonfinite=on_nonfinite)
    if cluster and (remove_run or keep_runs):
        raise ConfigError("--rm and --keep-runs are for the embedded cluster's runs; a cluster's coordinators keep its "
                          "runs (their --keep-runs; `rallypoint delete-run` deletes one)")
    embedded = not reference and not cluster
    if embedded and platforms and "," in platforms:
        raise ConfigError(f"--platform {platforms}: an embedded cluster's workers run on one platform; give one")
    for name, value in (("--checkpoint-every", checkpoint_every), ("--keep-checkpoints", keep_checkpoints),
                        ("--wait-timeout-s", wait_timeout_s), ("--stall-timeout-s", stall_timeout_s),
                        ("--max-faults", max_faults), ("--max-preemptions", max_preemptions),
                        ("--failure-window-s", failure_window_s), ("--compile-timeout-s", compile_timeout_s)):
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    if warm_spares is not None and warm_spares < 0:
        raise ConfigError(f"--warm-spares must be >= 0 (0: off), got {warm_spares}")
    if straggler_factor is not None and straggler_factor <= 1:
        raise ConfigError(f"--straggler-factor must be > 1 (a slice that many times slower straggles), "
                          f"got {straggler_factor}")
    faults = parse_faults(fail, slices=list(program.slices), node_slices={n: s.slice for n, s in program.nodes.items()},
                          steps=program.steps)
    if cluster and any(f.corrupts for f in faults):
        raise ConfigError("--fail corrupt arms the workers' corrupt hook, which only an embedded cluster's workers "
                          "are started with: drop --cluster")
    recovery = {"policy": policy, "checkpoint_every": checkpoint_every, "keep_checkpoints": keep_checkpoints,
                "on_no_spare": on_no_spare, "wait_timeout_s": wait_timeout_s, "stall_timeout_s": stall_timeout_s,
                "priority": priority, "stragglers": stragglers, "straggler_factor": straggler_factor,
                "warm_spares": warm_spares, "max_faults": max_faults, "max_preemptions": max_preemptions,
                "failure_window_s": failure_window_s, "compile_timeout_s": compile_timeout_s,
                "on_nonfinite": on_nonfinite, "code_dir": str(code_dir) if code_dir else None,  # submit settings,
                "tensorboard": str(tensorboard) if tensorboard else None,  # beside the recovery ones
                "wandb": str(wandb) if wandb else None, **spikes}
    compiled = compile_program(program, platforms=export_platforms_for(platforms, reference=reference,
                                                                          cluster=cluster))
    if not reference and (program.host_sources or code_dir or tensorboard or wandb):  # before any cluster starts:
        from rallypoint.client.jobspec import job_spec  # the bundle's errors, a tracker directory not writable

        job_spec(compiled, code_dir=code_dir, tensorboard=tensorboard, wandb=wandb)
    if detach:
        _detach(compiled, cluster, window, new_run, recovery, as_json)
        return
    where = "reference"
    after: list[str] = []  # lines said once the run's summary is out (where an embedded run was kept)
    says: list[Callable[[dict[str, Any]], None]] = [lambda d: click.echo(json.dumps(d))]  # the bar's console, once up
    if reference:
        board = _reference_board(program.name, tensorboard)

        def runner(on_step: Callable[[int, dict[str, float]], None]) -> Any:
            def step(s: int, metrics: dict[str, float]) -> None:
                if board is not None:
                    board.metrics(s, metrics)
                on_step(s, metrics)
            try:
                return ReferenceExecutor(compiled, on_step=step, on_nonfinite=on_nonfinite,  # the cluster's policy
                                         on_event=lambda d: says[0](d), skips=skips).run()
            finally:
                if board is not None:
                    board.close()
    else:
        where = "cluster" if cluster else "embedded cluster"

        def runner(on_step: Callable[[int, dict[str, float]], None]) -> Any:
            result = _run_on_cluster(compiled, cluster, workers, spares, devices_per_worker, window, on_step, as_json,
                                     faults=faults, say=lambda d: says[0](d), recovery=recovery,
                                     new_run=new_run, platform=platforms or "cpu",
                                     runs=EmbeddedRuns(remove=remove_run, keep=keep_runs), after=after)
            if any(f.corrupts for f in faults):  # what the corruption did: the reference's digest beside the run's
                ref = ReferenceExecutor(compiled).run().state_digest
                says[0]({"event": "digest.compared", "job": program.name, "state_digest": result.state_digest,
                         "reference_digest": ref, "equal": ref == result.state_digest})
            return result

    with stops(program.name, attached=bool(cluster)):
        _show(program, runner, as_json, where, says)
    for line in after:
        click.echo(line)


def _reference_board(job: str, tensorboard: Path | None) -> Any:
    """``--reference --tensorboard DIR``: this process writes the event files, under DIR/JOB/reference."""
    if tensorboard is None:
        return None
    from rallypoint.client.jobspec import writable_dir
    from rallypoint.orchestrator.api import TensorBoardSink

    return TensorBoardSink(writable_dir(tensorboard, "--tensorboard") / job / "reference")


def _detach(compiled: Any, cluster: str | None, window: int, new_run: bool, recovery: dict[str, Any],
            as_json: bool) -> None:
    from rallypoint.client.lifecycle import submit_detached

    addr = resolve_cluster(Path(DEFAULT_STATE_DIR), cluster)
    with stops(compiled.program.name, attached=True):
        got = submit_detached(compiled, endpoints=addr.endpoints, cluster=addr.name, window=window, new_run=new_run,
                              **recovery)
    if as_json:
        click.echo(json.dumps({"event": "job.detached", **got}))
        return
    where = ", ".join(f"{s}@{p['worker']}" for s, p in sorted(got["placement"].items()))
    click.echo(f"job {got['job']} runs: run {got['run']}, on {where or '-'}")
    click.echo(f"  follow it: rallypoint watch {got['job']}    its events: rallypoint logs {got['job']}    "
               f"stop it: rallypoint cancel {got['job']}")


def _show(program: Any, runner: Callable[..., Any], as_json: bool, where: str,
          says: list[Callable[[dict[str, Any]], None]]) -> None:
    """Run ``runner`` showing its steps: JSON lines, or a progress bar whose console gets the fault lines."""
    if as_json:
        def on_step(step: int, metrics: dict[str, float]) -> None:
            click.echo(json.dumps({"event": "step", "job": program.name, "step": step, "metrics": metrics}))

        result = runner(on_step)
        click.echo(json.dumps(result.finished_event()))
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[metrics]}"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn()) as bar:
        task = bar.add_task(f"{program.name} ({where})", total=program.steps, metrics="", rate="")
        says[0] = lambda d: bar.console.print(describe_event(d))

        first: list[float] = []

        def show(step: int, metrics: dict[str, float]) -> None:
            now = time.perf_counter()
            if not first:
                first.append(now)
            rate = f"{step / (now - first[0]):.1f} steps/s" if step and now > first[0] else ""  # from step 0's end
            bar.update(task, advance=1, metrics=" ".join(f"{k} {v:.4f}" for k, v in metrics.items()), rate=rate)

        result = runner(show)
    rec = result.recovery
    extra = ""
    if rec.get("failures"):
        mttr = [r["mttr_s"] for r in rec.get("recoveries", []) if r.get("mttr_s") is not None]
        extra = (f"; {len(rec['failures'])} failures, {len(rec.get('recoveries', []))} recoveries"
                 + (f" (MTTR {', '.join(f'{m:.2f}s' for m in mttr)})" if mttr else "")
                 + f", replayed {sum(rec.get('replayed_instances', {}).values())} instances")
    click.echo(f"{program.name}: {result.steps} steps in {result.wall_s:.2f}s, state digest {result.state_digest}{extra}")


def _run_on_cluster(compiled: Any, cluster: str | None, workers: int | None, spares: int,
                    devices_per_worker: int | None, window: int,
                    on_step: Callable[[int, dict[str, float]], None], quiet: bool, *, faults: Any = (),
                    say: Callable[[dict[str, Any]], None] = lambda _: None, recovery: dict[str, Any] | None = None,
                    new_run: bool = False, platform: str = "cpu", runs: EmbeddedRuns = EmbeddedRuns(),
                    after: list[str] | None = None) -> Any:
    """Submit to ``--cluster``, or start an embedded local cluster for the run and stop it after (its run kept)."""
    import tempfile

    from rallypoint.client.commands.faults import FaultInjector
    from rallypoint.client.submission import submit
    from rallypoint.cluster.local import LocalCluster, LocalClusterConfig
    from rallypoint.cluster.local_devices import local_plan
    from rallypoint.proto import rallypoint_pb2 as pb
    from rallypoint.workers.faults import WorkerFaults

    program = compiled.program
    recovery = recovery or {}

    def go(endpoints: Any, name: str, *, fresh: bool, corrupt_flag: str = "") -> Any:
        injector = FaultInjector(list(faults), endpoints, name, log=say, corrupt_flag=corrupt_flag)

        def on_event(ev: pb.JobEvent) -> None:
            injector.on_event(ev)
            if ev.event in ("job.recovering", "job.recovered", "job.waiting", "job.straggler", "job.nonfinite",
                            "job.spike", "job.rolled_back", "job.verify_mismatch", "job.sdc"):
                say({"event": ev.event, "job": ev.job, "step": ev.step, **json.loads(ev.detail or "{}")})

        return submit(compiled, endpoints=endpoints, cluster=name, window=window, on_step=on_step, on_event=on_event,
                      new_run=fresh, **recovery)

    if cluster:
        addr = resolve_cluster(Path(DEFAULT_STATE_DIR), cluster)
        return go(addr.endpoints, addr.name, fresh=new_run)
    n_workers = workers if workers is not None else len(program.slices)
    plan, host_devices = local_plan(platform, processes=n_workers + spares, devices_per_worker=devices_per_worker
                                    or max(s.devices for s in program.slices.values()))
    k = plan.devices_per_worker
    program.validate_for_cluster(workers=n_workers, devices_per_worker=k)
    configure_logs(level="warning")
    root = runs_root()
    state = Path(tempfile.mkdtemp(prefix=f"rallypoint-{program.name}-"))
    if not quiet:
        click.echo(f"starting an embedded cluster: {n_workers} workers + {spares} spares x {plan.describe()} ({state})")
    kills = [f for f in faults if not f.corrupts]
    if len(kills) > spares and recovery.get("on_no_spare") != "fail":
        click.echo(f"note: {len(kills)} kills and {spares} spares: recovery will wait for spares that never come; "
                   "add --spares", err=True)
    # --fail corrupt: the workers read corrupt specs from this file (workers/corruption.py); without, none can
    corrupt_flag = str(state / "corrupt-fault.json") if any(f.corrupts for f in faults) else ""
    lc = LocalCluster.start(LocalClusterConfig(state_dir=state, workers=n_workers, spares=spares, devices_per_worker=k,
                                               coordinators=2, tls=not insecure(), checkpoint_dir=root,
                                               platform=plan.platform, host_devices=host_devices,
                                               worker_faults=WorkerFaults(corrupt_flag=corrupt_flag)))
    ok = False
    try:
        # This process's library logging (absl, Orbax, JAX) joins the cluster's logs, not the progress bar's lines.
        with library_logs_to(state / "logs" / "client.log"):
            result = go(lc.endpoints, lc.config.cluster, fresh=True,  # each embedded run is a run of its own
                        corrupt_flag=corrupt_flag)
        ok = True
        return result
    finally:
        lc.stop()
        if ok:
            import shutil

            shutil.rmtree(state, ignore_errors=True)
            kept, gone = settle(root, program.name, runs)
            if not quiet and after is not None:
                after += _kept_lines(program.name, root, kept, gone)
        else:
            click.echo(f"the embedded cluster's logs are in {state / 'logs'}; the run is in {root / program.name}",
                       err=True)


def _kept_lines(job: str, root: Path, kept: Path | None, gone: list[str]) -> list[str]:
    lines = [f"deleted runs: {', '.join(gone)}"] if gone else []
    if kept is None:
        return lines
    state = root.parent
    flag = "" if state == Path(DEFAULT_STATE_DIR).absolute() else f" --state-dir {state}"
    return [*lines, f"run kept: {kept} (checkpoints with the final state, metrics, events, code)",
            f"  its weights: rallypoint export {job}{flag} --out DIR    its curves: rallypoint plot {job}{flag}"]
