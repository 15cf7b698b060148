"""Operator commands for jobs: ``rallypoint jobs``, ``rallypoint status JOB``, ``rallypoint resume JOB``
and ``rallypoint delete-run JOB RUN``.

``resume`` is for a whole-cluster loss (or a failed job): after a leader loss the new
leader adopts every running job by itself, and clients follow it there.

Added to the ``rallypoint`` group by :mod:`rallypoint.client.commands.main`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from rallypoint.etcd.records import parsed
from rallypoint.client.commands.clusters import cluster_options, resolve_cluster, store_and_keys
from rallypoint.basics.errors import RallypointError
from rallypoint.etcd.keys import check_name
from rallypoint.recovery.skips import Skips


def job_status(store: Any, keys: Any, job: str) -> dict[str, Any]:
    """The job's record in etcd with its newest commit per slice.

    Raises:
        RallypointError: the cluster has no record of ``job``.
    """
    from rallypoint.etcd.commits import consistent_cut, read_commits

    kv = store.get(keys.job(job))
    if kv is None:
        raise RallypointError(f"cluster {keys.cluster!r} has no job {job!r}; `rallypoint status` takes a job name "
                              "that was submitted to this cluster")
    from rallypoint.orchestrator.api import old_runs, run_of

    record = parsed(kv, "job")
    if record is None:
        raise RallypointError(f"the record of job {job!r} in etcd is malformed (logged as record.bad): "
                              f"rewrite or delete {kv.key}")
    record["run"] = run_of(record)
    record["earlier_runs"] = [{k: r.get(k) for k in ("run", "state", "step_done", "steps", "commits", "run_dir")}
                              for r in old_runs(store, keys, job)]
    commits = read_commits(store, keys, job)
    record["last_commits"] = {s: {"step": cs[-1].step, "path": cs[-1].path, "checksum": cs[-1].checksum}
                              for s, cs in sorted(commits.items()) if cs}
    record["consistent_cut"] = consistent_cut(commits, list(record.get("placement") or commits)) if commits else None
    return record


def _recoveries(r: dict[str, Any]) -> int:
    return len(r.get("recoveries") or []) + int((r.get("recoveries_earlier") or {}).get("count", 0))


def job_rows(store: Any, keys: Any, *, history: bool = True) -> list[dict[str, Any]]:
    """One row per run of the cluster's jobs: each job's current run (running, suspended, or ended and within
    the leader's ``--keep-history-s``) and, with ``history``, its earlier runs kept in etcd. Each row: priority,
    state, progress, start and end, recoveries, devices held now, placement, and who stopped it."""
    from collections import Counter

    from rallypoint.etcd.cluster_view import job_records, read_cluster
    from rallypoint.orchestrator.api import old_runs, run_of

    records = job_records(store, keys)
    snap = read_cluster(store, keys)
    held = Counter(h.job for ws in snap.workers.values() for h in ws.holders.values())
    yields, _ = store.get_prefix(keys.yields)
    asked = Counter(keys.tail(kv.key, keys.yields)[0] for kv in yields)
    rows = []

    def row(job: str, r: dict[str, Any], current: bool) -> dict[str, Any]:
        stop = r.get("stop") or {}
        return {"job": job, "run": run_of(r), "current": current, "priority": int(r.get("priority", 0)),
                "state": r.get("state", ""), "step_done": r.get("step_done", 0), "steps": r.get("steps", 0),
                "started_at": r.get("started_at"), "ended_at": r.get("ended_at") or r.get("superseded_at"),
                "devices_held": held.get(job, 0) if current else 0,
                "slices": {s: {"worker": p["worker"], "devices": len(p["devices"])}
                           for s, p in sorted((r.get("placement") or {}).items())} if current else {},
                "asked_to_yield": asked.get(job, 0) if current else 0, "recoveries": _recoveries(r),
                "drains": len(r.get("drains") or []), "reason": r.get("reason", ""),
                **({"stopped_by": stop.get("by", ""), "auto_resume": bool(stop.get("auto_resume"))} if stop else {})}

    for job, r in sorted(records.items(), key=lambda kv: (-int(kv[1].get("priority", 0)), kv[0])):
        rows.append(row(job, r, True))
        if history:
            rows += [row(job, old, False) for old in reversed(old_runs(store, keys, job))]
    return rows


def _when(t: Any) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(float(t))) if t else "-"


def _state_cell(r: dict[str, Any]) -> str:
    state = r["state"] + ("" if r["current"] else " (earlier run)")
    if r.get("stopped_by"):
        state += f", by {r['stopped_by']}"
        if r["state"] == "suspended" and r.get("auto_resume"):
            state += "; resumes by itself when room returns"
    return state


@click.command()
@cluster_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run, per line.")
@click.option("--current", is_flag=True, help="Only each job's current run (no earlier runs).")
def jobs(state_dir: Path, cluster: str | None, as_json: bool, current: bool) -> None:
    """List the cluster's jobs, running and past: run, priority, state (and who stopped it), progress, start and
    end, recoveries, devices held, placement. Ended runs stay listed for the leader's --keep-history-s."""
    store, keys = store_and_keys(state_dir, cluster)
    try:
        rows = job_rows(store, keys, history=not current)
    finally:
        store.close()
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cluster {keys.cluster}: {len(rows)} runs of {len({r['job'] for r in rows})} jobs "
                        "(highest priority first)")
    for col in ("job", "run", "priority", "state", "step", "started", "ended", "recoveries", "devices held",
                "placement", "asked to yield"):
        table.add_column(col)
    for r in rows:
        where = ", ".join(f"{s}@{p['worker']}x{p['devices']}" for s, p in r["slices"].items()) or "-"
        table.add_row(r["job"], r["run"] or "-", str(r["priority"]), _state_cell(r), f"{r['step_done']}/{r['steps']}",
                      _when(r["started_at"]), _when(r["ended_at"]), str(r["recoveries"]), str(r["devices_held"]),
                      where, str(r["asked_to_yield"] or "-"))
    Console(width=200).print(table)


@click.command()
@cluster_options
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="The record as one JSON object.")
def status(state_dir: Path, cluster: str | None, job: str, as_json: bool) -> None:
    """State, step, placement, last commits, failures and recoveries of JOB."""
    check_name("job", job)
    store, keys = store_and_keys(state_dir, cluster)
    try:
        rec = job_status(store, keys, job)
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps(rec))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console(width=120)
    age = time.time() - float(rec.get("at", time.time()))
    con.print(f"job [bold]{job}[/bold] (run {rec.get('run') or '-'}): {rec['state']}, step {rec.get('step_done', 0)}/{rec.get('steps')}, policy "
              f"{rec.get('policy') or '-'}, consistent cut {rec.get('consistent_cut')}, updated {age:.0f}s ago")
    if rec.get("reason"):
        con.print(f"reason: {rec['reason']}")
    stop = rec.get("stop") or {}
    if stop:
        con.print(f"{stop.get('action')} asked by {stop.get('by')} at {_when(stop.get('at'))}"
                  + (f": {stop['reason']}" if stop.get("reason") else "")
                  + ("; it resumes by itself when room returns" if stop.get("auto_resume") and
                     rec["state"] == "suspended" else "")
                  + (f"; `rallypoint resume {job}` continues it" if rec["state"] in ("suspended", "cancelled")
                     else ""))
    table = Table(title="placement and last commits")
    for col in ("slice", "worker", "devices", "last commit", "checkpoint"):
        table.add_column(col)
    commits = rec.get("last_commits", {})
    for s, p in sorted(rec.get("placement", {}).items()):
        c = commits.get(s, {})
        table.add_row(s, p["worker"], ",".join(map(str, p["devices"])), str(c.get("step", "-")), c.get("path", "-"))
    con.print(table)
    for r in rec.get("earlier_runs", []):
        con.print(f"earlier run {r['run']}: {r.get('state')}, step {r.get('step_done')}/{r.get('steps')}, "
                  f"{r.get('commits')} commits kept, files {r.get('run_dir') or '-'} "
                  f"(`rallypoint delete-run {job} {r['run']}` deletes it)")
    for f in rec.get("failures", []):
        con.print(f"failure: worker {f['worker']} (incarnation {f['incarnation']}, slices {', '.join(f['slices'])}) "
                  f"at step {f['step']}: {f['reason']}")
    for line in integrity_lines(rec):
        con.print(line)
    for r in rec.get("recoveries", []):
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in r.get("phases", {}).items())
        con.print(f"recovery {r['recovery']} ({r['policy']}, from step {r['checkpoint_step']}): moved "
                  f"{r.get('moved')}; replayed {r.get('planned_instances')}; {phases}"
                  + (f"; MTTR {r['mttr_s']:.3f}s" if r.get("mttr_s") is not None else ""))



def integrity_lines(rec: dict[str, Any]) -> list[str]:
    """``rallypoint status``'s lines on a run's skipped batches, rollbacks and verifications (docs/integrity.md)."""
    out = []
    try:
        skips = Skips.from_json(rec.get("skips"))
    except ValueError as exc:
        out.append(f"skipped stream positions: the record's are malformed ({exc})")
    else:
        if skips:
            out.append("skipped stream positions (rolled-back spikes; `rallypoint run --reference` reads the same "
                       "with: " + " ".join(f"--skip {r}" for r in skips.ranges) + ")")
    for r in _dicts(rec.get("rollbacks")):
        spike, steps = r.get("spike") if isinstance(r.get("spike"), dict) else {}, r.get("skipped_steps")
        skipped = f"{steps[0]}..{steps[1] - 1}" if isinstance(steps, list) and len(steps) == 2 and all(
            isinstance(x, int) for x in steps) else "?"
        out.append(f"rollback {r.get('rollback')}: {spike.get('metric')} {spike.get('value')} at step {spike.get('step')}"
                   f" -> back to the cut at step {r.get('cut')}, the batches of steps {skipped} skipped")
    v = rec.get("verifications") if isinstance(rec.get("verifications"), dict) else {}
    if v.get("verified") or v.get("mismatched"):
        out.append(f"verifications: {v.get('verified', 0)} matched, {v.get('mismatched', 0)} mismatched, "
                   f"{v.get('convicted', 0)} convicted")
    for m in _dicts(v.get("mismatches")):
        out.append(f"verification mismatch on slice {m.get('slice')} (steps {m.get('from_step')}..{m.get('to_step')}, "
                   f"{m.get('primary')} vs {m.get('verifier')}): {m.get('verdict')}"
                   + (f", suspect {m['suspect']}" if m.get("suspect") else ""))
    return out


def _dicts(value: Any) -> list[dict[str, Any]]:
    """The objects of a record's list (anything else in it, or a list that is not one, is left out)."""
    return [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []


@click.command()
@cluster_options
@click.argument("job")
@click.option("--checkpoint-dir", default="", help="The checkpoint root the job ran with (default: the coordinator's).")
@click.option("--detach", is_flag=True, help="Return once the job runs again (`rallypoint watch JOB` follows it).")
@click.option("--json", "as_json", is_flag=True, help="One JSON event per line.")
def resume(state_dir: Path, cluster: str | None, job: str, checkpoint_dir: str, detach: bool, as_json: bool) -> None:
    """Restart every slice of JOB from its newest consistent cut and finish it.

    For a suspended or cancelled job (placed again on the devices free now, nothing replayed
    after a suspend), a failed one, or a cluster that lost everything (etcd included): a job
    whose leader died or was deposed needs no resume, the new leader adopts it by itself (if
    it already runs, this follows it). Exit status as `rallypoint watch`."""
    from rallypoint.client.lifecycle import resume_detached
    from rallypoint.client.commands.output import stops
    from rallypoint.client.submission import resume as resume_job

    check_name("job", job)
    addr = resolve_cluster(state_dir, cluster)
    root = str(Path(checkpoint_dir).absolute()) if checkpoint_dir else ""
    if detach:
        with stops(job, attached=True):
            got = resume_detached(job, endpoints=addr.endpoints, cluster=addr.name, checkpoint_dir=root)
        click.echo(json.dumps({"event": "job.detached", **got}) if as_json else
                   f"job {job} runs again: run {got['run']} (`rallypoint watch {job}` follows it)")
        return

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if as_json:
            click.echo(json.dumps({"event": "step", "job": job, "step": step, "metrics": metrics}))

    def on_event(ev: Any) -> None:
        d = json.loads(ev.detail or "{}")
        if ev.event == "job.resumed":
            line = {"event": "job.resumed", "job": job, "step": int(ev.step), **d}
            click.echo(json.dumps(line) if as_json else f"{job}: resumed from the consistent cut at step {ev.step}")
        elif ev.event == "job.handed_off":  # the leader's term ended: the new leader adopts the job
            line = {"event": "job.handed_off", "job": job, "step": int(ev.step), **d}
            click.echo(json.dumps(line) if as_json else f"{job}: its leader stepped down at step {ev.step} "
                                                        f"({d.get('reason', '')}); following it to the new leader")
        elif ev.event == "job.adopted":
            line = {"event": "job.adopted", "job": job, "step": int(ev.step), **d}
            click.echo(json.dumps(line) if as_json else f"{job}: the new leader adopted it from the cut at step "
                                                        f"{ev.step}")

    with stops(job, attached=True):
        done = resume_job(job, endpoints=addr.endpoints, cluster=addr.name, checkpoint_dir=root, on_step=on_step,
                          on_event=on_event)
    if as_json:
        click.echo(json.dumps({"event": "job.finished", **done}))
    else:
        click.echo(f"{job}: {done['steps']} steps (resumed at {done.get('start_step')}), "
                   f"state digest {done.get('state_digest')}")


@click.command("delete-run")
@cluster_options
@click.argument("job")
@click.argument("run")
@click.option("--checkpoint-dir", default="", help="The checkpoint root the run's files are under (where the "
              "coordinators keep checkpoints); without it only the run's etcd records and commits go.")
def delete_run(state_dir: Path, cluster: str | None, job: str, run: str, checkpoint_dir: str) -> None:
    """Delete an earlier run RUN of JOB (its commits, record and files); the current run is never deleted.

    A new run (`rallypoint run ... --new-run`) keeps the old one under its run id; this, or the
    coordinators' --keep-runs retention, is the only way an old run goes."""
    from rallypoint.orchestrator.api import check_run_id, delete_run as delete

    check_name("job", job)
    check_run_id(run)
    store, keys = store_and_keys(state_dir, cluster)
    try:
        gone = delete(store, keys, lambda ops: store.txn([], ops), job, run,
                      str(Path(checkpoint_dir).absolute()) if checkpoint_dir else "")
    finally:
        store.close()
    click.echo(f"{job}: deleted run {run} ({gone['etcd_keys']} etcd keys"
               + (f", files {gone['run_dir']}" if gone["run_dir"] else "") + ")")
