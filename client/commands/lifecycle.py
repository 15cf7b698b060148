"""Operator commands for a job's life: ``rallypoint watch``, ``cancel``, ``suspend`` and ``logs``.

Exit status, for ``watch``, ``run`` and ``resume`` alike: :data:`~rallypoint.client.commands.output.EXIT`.

Added to the ``rallypoint`` group by :mod:`rallypoint.client.commands.main`.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from rallypoint.etcd.records import parsed
from rallypoint.basics.errors import RallypointError
from rallypoint.client.commands.clusters import cluster_options, resolve_cluster, store_and_keys
from rallypoint.client.commands.output import DETACHED, EXIT, describe_event, detached, progress_bar, say
from rallypoint.etcd.keys import check_name

FOLLOW_POLL_S = 0.5  # logs --follow: how often the log is read again


def _record(state_dir: Path, cluster: str | None, job: str) -> tuple[dict[str, Any], Any]:
    store, keys = store_and_keys(state_dir, cluster)
    try:
        kv = store.get(keys.job(job))
    finally:
        store.close()
    if kv is None:
        raise RallypointError(f"cluster {keys.cluster!r} has no job {job!r} (`rallypoint jobs` lists its jobs)")
    record = parsed(kv, "job")
    if record is None:
        raise RallypointError(f"the record of job {job!r} in etcd is malformed (logged as record.bad): "
                              f"rewrite or delete {kv.key}")
    return record, keys


def describe_past(d: dict[str, Any]) -> list[str]:
    """What happened to a job before a client watched it (a ``job.watching`` detail), a line each."""
    lines = []
    for r in d.get("recoveries") or []:
        mttr = f", MTTR {r['mttr_s']:.2f}s" if r.get("mttr_s") is not None else ""
        lines.append(f"  recovery {r.get('recovery')}: lost {', '.join(sorted(r.get('lost') or r.get('reasons') or {}))}"
                     f", restored the cut at step {r.get('checkpoint_step')}{mttr}")
    for dr in d.get("drains") or []:
        lines.append(f"  drain {dr.get('drain')} of worker {dr.get('worker')} ({dr.get('reason')}) at step "
                     f"{dr.get('step')}: {dr.get('state')}")
    stop = d.get("stop") or {}
    if stop:
        lines.append(f"  {stop.get('action')} asked by {stop.get('by')}" + (f": {stop['reason']}" if stop.get("reason")
                                                                             else ""))
    return lines


@click.command()
@cluster_options
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="One JSON event per line instead of a progress bar.")
def watch(state_dir: Path, cluster: str | None, job: str, as_json: bool) -> None:
    """Follow JOB to its end (from any terminal, at any time, through leader changes).

    Shows what happened before (recoveries, drains), then its progress. Ctrl-C detaches: the
    job goes on. Exit status: 0 finished, 1 failed, 3 cancelled, 4 suspended, 130 detached."""
    from rallypoint.client.lifecycle import watch as follow
    from rallypoint.client.submission import JobStoppedError
    from rallypoint.orchestrator.api import FINAL_RECORD_STATES

    check_name("job", job)
    record, _keys = _record(state_dir, cluster, job)
    state = str(record.get("state", ""))
    waits = state == "suspended" and bool((record.get("stop") or {}).get("auto_resume"))  # the leader resumes it
    if state in FINAL_RECORD_STATES and not waits:  # nothing runs: its end, from the record
        line = {"event": "job.watching", "job": job, "state": state, "run": record.get("run"),
                "step": record.get("step_done"), "steps": record.get("steps"), "reason": record.get("reason", "")}
        click.echo(json.dumps(line) if as_json else f"job {job} (run {record.get('run')}) is {state} at step "
                   f"{record.get('step_done')}/{record.get('steps')}" + (f": {record['reason']}" if record.get("reason")
                                                                          else ""))
        sys.exit(EXIT.get(state, 1))
    addr = resolve_cluster(state_dir, cluster)
    seen: dict[str, int] = {"step": int(record.get("step_done") or 0)}
    bar = None if as_json else progress_bar()
    task = bar.add_task(job, total=int(record.get("steps") or 0), completed=seen["step"], metrics="") if bar else None
    out = bar.console.print if bar is not None else say

    def on_event(ev: Any) -> None:
        d = json.loads(ev.detail or "{}")
        if ev.event == "step.done":
            seen["step"] = int(ev.step)
            if as_json:
                say(json.dumps({"event": "step", "job": job, "step": int(ev.step), "metrics": dict(ev.metrics)}))
            elif bar is not None and task is not None:
                bar.update(task, completed=int(ev.step) + 1,
                           metrics=" ".join(f"{k} {v:.4f}" for k, v in sorted(ev.metrics.items())))
            return
        if as_json:
            say(json.dumps({"event": ev.event, "job": job, "step": int(ev.step), **d}))
        elif ev.event == "job.watching":
            out(f"watching job {job} (run {d.get('run') or record.get('run')}): {d.get('state')}, step "
                f"{ev.step}/{record.get('steps')}")
            if bar is not None and task is not None:
                bar.update(task, completed=int(ev.step))
            past = describe_past(d)
            if past:
                out("before this watch:\n" + "\n".join(past))
        elif ev.event in ("job.handed_off", "job.adopted", "job.stopping", "job.drained", "job.recovering",
                          "job.recovered", "job.waiting", "job.straggler", "job.resumed"):
            out(describe_event({"event": ev.event, "step": int(ev.step), **d}))

    try:
        with bar if bar is not None else contextlib.nullcontext():
            end = follow(job, endpoints=addr.endpoints, cluster=addr.name, on_event=on_event)
    except KeyboardInterrupt:
        detached(job, seen["step"])
    except JobStoppedError as exc:
        click.echo(json.dumps({"event": f"job.{exc.state}", "job": job, "reason": str(exc)}) if as_json
                   else f"job {job} {exc.state}: {exc}")
        sys.exit(EXIT[exc.state])
    if not as_json:  # as JSON, job.finished was the last event printed
        d = json.loads(end.detail or "{}")
        click.echo(f"job {job} finished: {end.step} steps, state digest {d.get('state_digest')}")


def _stop(action: str, state_dir: Path, cluster: str | None, job: str, checkpoint: bool, reason: str, no_wait: bool,
          as_json: bool) -> None:
    from rallypoint.client.lifecycle import control, watch as follow
    from rallypoint.client.submission import JobError, JobStoppedError

    check_name("job", job)
    addr = resolve_cluster(state_dir, cluster)
    reply = control(job, action, endpoints=addr.endpoints, cluster=addr.name, checkpoint=checkpoint,
                    by=f"operator {getpass.getuser()}", reason=reason)
    if not as_json:
        click.echo(reply.message)
    if no_wait or reply.state in ("suspended", "cancelled"):
        if as_json:
            click.echo(json.dumps({"job": job, "state": reply.state, "run": reply.run, "message": reply.message}))
        return
    t0 = time.monotonic()
    try:
        follow(job, endpoints=addr.endpoints, cluster=addr.name)
        state, why = "succeeded", "it finished before it could stop (every step was granted)"
    except JobStoppedError as exc:
        state, why = exc.state, str(exc)
    except JobError as exc:
        state, why = "failed", str(exc)
    out = {"job": job, "state": state, "run": reply.run, "reason": why, "stop_s": round(time.monotonic() - t0, 3)}
    click.echo(json.dumps(out) if as_json else f"job {job} {state} ({out['stop_s']}s): {why}")
    if state != {"cancel": "cancelled", "suspend": "suspended"}[action]:
        sys.exit(1)


@click.command()
@cluster_options
@click.argument("job")
@click.option("--checkpoint", is_flag=True, help="Commit a final consistent cut first (every slice saved at the "
              "step boundary it stops at), so `rallypoint resume JOB` continues from there.")
@click.option("--reason", default="", help="Why, kept in the job's record.")
@click.option("--no-wait", is_flag=True, help="Return once the leader took the request.")
@click.option("--json", "as_json", is_flag=True, help="The outcome as one JSON object.")
def cancel(state_dir: Path, cluster: str | None, job: str, checkpoint: bool, reason: str, no_wait: bool,
           as_json: bool) -> None:
    """Stop JOB, unload it and release its devices: CANCELLED. At once; with --checkpoint at its
    next step boundary, every slice saved there.

    Its run directory and commits stay: `rallypoint resume JOB` continues it. A job that
    is over, or asked to stop already, is refused with nothing changed."""
    _stop("cancel", state_dir, cluster, job, checkpoint, reason, no_wait, as_json)


@click.command()
@cluster_options
@click.argument("job")
@click.option("--reason", default="", help="Why, kept in the job's record.")
@click.option("--no-wait", is_flag=True, help="Return once the leader took the request.")
@click.option("--json", "as_json", is_flag=True, help="The outcome as one JSON object.")
def suspend(state_dir: Path, cluster: str | None, job: str, reason: str, no_wait: bool, as_json: bool) -> None:
    """Set JOB aside: every slice saved at its next step boundary, every device released: SUSPENDED.

    `rallypoint resume JOB` places it again on the devices free then and goes on with nothing
    replayed. Needs checkpoints; operator role."""
    _stop("suspend", state_dir, cluster, job, False, reason, no_wait, as_json)


def _lines(path: Path, follow: bool, ends: frozenset[str]) -> Iterator[dict[str, Any]]:
    """The events of ``path`` (a line each); with ``follow``, also those written later, until the log's newest
    event is an end (a suspend or cancel in the middle of the log was followed by a resume)."""
    pos, last = 0, ""
    while True:
        if path.exists():
            with open(path, encoding="utf-8") as f:
                f.seek(pos)
                while True:
                    line = f.readline()
                    if not line.endswith("\n"):
                        break  # a line being written: read it whole next time
                    pos = f.tell()
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue
                    last = str(ev.get("event", ""))
                    yield ev
        if not follow or last in ends:
            return
        time.sleep(FOLLOW_POLL_S)


def describe_line(ev: dict[str, Any]) -> str:
    """One line of ``rallypoint logs``: the time, the step, the event and its fields."""
    skip = {"t", "event", "step", "term", "placement"}
    fields = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in ev.items()
                      if k not in skip and v not in (None, "", [], {}))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ev.get("t", 0))))
    return f"{when}  step {ev.get('step', 0):>6}  {ev.get('event', '?'):<20} {fields}"[:400]


@click.command()
@cluster_options
@click.argument("job")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events until the job stops running.")
@click.option("--checkpoint-dir", default="", help="The checkpoint root the job ran with: read its newest run's "
              "log there without the cluster (default: the run directory in the job's record).")
@click.option("--json", "as_json", is_flag=True, help="The log's lines as they are (JSON).")
def logs(state_dir: Path, cluster: str | None, job: str, follow: bool, checkpoint_dir: str, as_json: bool) -> None:
    """Print JOB's events (placed, started, recoveries, drains, stops, its end) from its run directory."""
    from rallypoint.orchestrator.api import EVENTS_FILE
    from rallypoint.orchestrator.api import END_EVENTS
    from rallypoint.orchestrator.api import run_dir

    check_name("job", job)
    if checkpoint_dir:
        rd = run_dir(Path(checkpoint_dir).absolute(), job, create=False)
    else:
        record, _ = _record(state_dir, cluster, job)
        if not record.get("run_dir"):
            raise RallypointError(f"job {job!r} ran without checkpoints: it has no run directory, so no event log "
                                  f"(`rallypoint status {job}` shows its record)")
        rd = Path(str(record["run_dir"]))
    path = rd / EVENTS_FILE
    if not path.exists() and not follow:
        raise RallypointError(f"job {job!r} has no event log at {path} yet (a run from before event logs, or "
                              "another machine's file system: give --checkpoint-dir)")
    try:
        for ev in _lines(path, follow, END_EVENTS):
            say(json.dumps(ev) if as_json else describe_line(ev))
    except KeyboardInterrupt:
        sys.exit(DETACHED)
