"""How a client shows a job it follows: one line per event, the exit status of its end, a Ctrl-C.

Shared by ``rallypoint run``, ``resume``, ``watch``, ``cancel``, ``suspend`` and ``logs``.
Exit status (:data:`EXIT`): 0 the job finished, 1 it failed (or the command was refused), 3 it
was cancelled, 4 it was suspended; 130 a following client detached with Ctrl-C (the job goes on).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import click

from rallypoint.client.commands import plot as plot_cli
from rallypoint.client.commands.integrity import describe_spike, describe_verification

EXIT = {"succeeded": 0, "failed": 1, "cancelled": 3, "suspended": 4}
DETACHED = 130  # Ctrl-C: the client went, the job goes on


def say(line: str) -> None:
    """One line out, flushed: a reader on a pipe (`watch --json | ...`, `logs --follow`) gets each as it comes."""
    click.echo(line)
    sys.stdout.flush()


def detached(job: str, step: int | None = None) -> None:
    """Ctrl-C of a following client: say so, and exit 130; the job is not touched."""
    at = f" at step {step}" if step is not None else ""
    click.echo(f"\ndetached from job {job}{at}; it goes on (`rallypoint watch {job}` follows it again, "
               f"`rallypoint cancel {job}` stops it)", err=True)
    sys.exit(DETACHED)


@contextlib.contextmanager
def stops(job: str, *, attached: bool) -> Iterator[None]:
    """A job suspended or cancelled exits 4 or 3 with why; Ctrl-C of a client of a cluster that stays detaches."""
    from rallypoint.client.submission import JobStoppedError

    try:
        yield
    except JobStoppedError as exc:
        click.echo(f"job {job} {exc.state}: {exc}", err=True)
        sys.exit(EXIT[exc.state])
    except KeyboardInterrupt:
        if not attached:
            raise
        detached(job)


def progress_bar() -> Any:
    """The progress bar of a job followed in a terminal: name, bar, steps done of all, metrics, elapsed time
    (a task's ``metrics`` field). Used as a context manager; its ``console`` prints lines above it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[metrics]}"), TimeElapsedColumn())


def describe_event(d: dict[str, Any]) -> str:
    """One line for a fault or recovery event in the progress output."""
    ev = d.get("event", "")
    if ev == "fault.injected" and d.get("armed"):
        when = "at every state update from" if d.get("mode") == "persist" else "once, at"
        return (f"[red]fault[/red] {d['fault']}: worker {d.get('worker')} flips a bit of {d.get('slice')}'s state "
                f"{when} step {d['step']} (silently)")
    if ev == "digest.compared":
        if d.get("equal"):
            return f"state digest {d.get('state_digest')} equals the in-process reference's"
        return (f"[red]state digest {d.get('state_digest')} differs from the in-process reference's "
                f"{d.get('reference_digest')}[/red]: the corruption went undetected")
    if ev == "fault.injected":
        what = f"pid {d['pid']} SIGKILL" if "pid" in d else f"not fired: {d.get('error')}"
        return f"[red]fault[/red] {d['fault']}: worker {d.get('worker')} ({what}) at step {d['step']}"
    if ev == "job.recovering":
        return f"[yellow]lost[/yellow] {', '.join(d.get('lost', {}))} at step {d.get('step')}: recovering"
    if ev == "job.recovered":
        moved = ", ".join(f"{s} -> {w}" for s, w in d.get("moved", {}).items())
        return (f"[green]recovered[/green] ({d.get('policy')}): {moved}; restored the cut at step "
                f"{d.get('checkpoint_step')}, replaying {sum(d.get('planned_instances', {}).values())} instances of "
                f"{', '.join(d.get('planned_instances', {})) or 'no node'}")
    if ev == "job.stopping":
        return (f"[yellow]{d.get('action')}[/yellow] asked by {d.get('by')}: every slice saves at step "
                f"{d.get('boundary')}" if d.get("checkpoint") else f"[yellow]{d.get('action')}[/yellow] asked by "
                f"{d.get('by')}: stopping at step {d.get('boundary')}")
    if ev == "job.drained":
        return f"[green]drained[/green] worker {d.get('worker')} at step {d.get('step')}: moved {d.get('moved')}"
    if ev == "job.handed_off":
        return f"[yellow]leader stepped down[/yellow] at step {d.get('step')}: following the job to the new leader"
    if ev in ("job.adopted", "job.resumed"):
        how = "the new leader adopted it" if ev == "job.adopted" else \
            ("resumed by the leader (room returned)" if d.get("auto") else "resumed")
        return f"[green]{how}[/green] from the cut at step {d.get('checkpoint_step', d.get('step'))}"
    if ev == "job.nonfinite":
        return plot_cli.describe_nonfinite(d)
    if ev in ("job.spike", "job.rolled_back"):
        return describe_spike(d)
    if ev in ("job.verify_mismatch", "job.sdc"):
        return describe_verification(d)
    if ev == "job.waiting":
        return f"[yellow]waiting[/yellow] {d.get('reason')}"
    if ev == "job.straggler":
        n = d.get("evidence", {}).get("slices", {}).get(d.get("slice"), {})
        numbers = (f" ({n['slowdown']:.1f}x its baseline, peers {n['peers_slowdown']:.1f}x)"
                   if "slowdown" in n else "")
        return f"[yellow]straggler[/yellow] {d.get('slice')} on {d.get('worker')}{numbers}: {d.get('decision')}: " \
               f"{d.get('reason')}"
    return json.dumps(d)
