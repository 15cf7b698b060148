"""``rallypoint run``'s integrity options (docs/integrity.md): the loss-spike policy, its detector and rollback,
the verifications that catch silent data corruption, and ``--skip`` for a reference run that reads what a
cluster run with rollbacks read.

:func:`spike_options` adds the options to a command and hands them to it as two arguments:
``spikes`` (the ``JobSpec`` fields, None where not given) and ``skips`` (a
:class:`~rallypoint.recovery.skips.Skips`, from ``--skip``). :func:`check_spikes` refuses what the
coordinator would refuse, before any cluster starts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import click

from rallypoint.basics.errors import ConfigError
from rallypoint.orchestrator.api import check_settings
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.skips import Skips
from rallypoint.recovery.spikes import ON_SPIKE, SPIKE_FIELDS, SpikeSettings

F = TypeVar("F", bound=Callable[..., Any])

_OPTIONS = (
    click.option("--on-spike", type=click.Choice(list(ON_SPIKE)), default=None,
                 help="A loss spike (docs/integrity.md): off (default), warn (a job.spike event), or rollback: back to "
                 "a cut at least --spike-rewind steps before it, skipping the batches of the steps from there to "
                 "--spike-skip steps past it."),
    click.option("--spike-metric", default=None, metavar="NAME", help="The metric judged (default loss)."),
    click.option("--spike-window", type=int, default=None, metavar="W",
                 help="The baseline: the median of the W steps before (default 20)."),
    click.option("--spike-factor", type=float, default=None,
                 help="A value over this many times the baseline is a spike (default 3)."),
    click.option("--spike-zscore", type=float, default=None, metavar="Z",
                 help="Judge by robust deviations instead: a value Z median absolute deviations (x1.4826) over the "
                 "baseline is a spike."),
    click.option("--spike-rewind", type=int, default=None, metavar="R",
                 help="Roll back to a cut at least R steps before the spike (default: the checkpoint interval)."),
    click.option("--spike-skip", type=int, default=None, metavar="K",
                 help="Skip the batches of the steps [spike - R, spike + K) (default 1)."),
    click.option("--max-rollbacks", type=int, default=None,
                 help="Rollbacks a run may make; one more fails the job, naming the spikes (default 3)."),
    click.option("--verify-every", type=int, default=None, metavar="K",
                 help="Every K-th cut, run one slice's steps since an earlier cut again on an idle worker and compare "
                 "the state it reaches with the commit, bit for bit; a mismatch is adjudicated on a third worker and "
                 "the odd one out cordoned (suspect-sdc). Default 0: never."),
    click.option("--verify-seed", type=int, default=None, help="Which slices the verifications pick (default 0)."),
    click.option("--verify-fraction", type=float, default=None, metavar="F",
                 help="A budget: a verification starts only while the steps verifications re-ran stay within F of the "
                 "steps the job's slices ran (0 to 1; with no --verify-every, every cut is a candidate)."),
    click.option("--skip", "skip", multiple=True, metavar="START:COUNT",
                 help="With --reference: skip stream positions START..START+COUNT-1 (repeatable), as a cluster run's "
                 "rollbacks did (`rallypoint status` shows its skips): the reference then reads the same batches."),
)


def spike_options(f: F) -> F:
    """Add the options to command ``f``, which takes them as ``spikes`` (dict) and ``skips`` (Skips)."""
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        spikes = {k: kwargs.pop(k) for k in SPIKE_FIELDS}
        try:
            skips = Skips.parse(kwargs.pop("skip"))
        except ValueError as exc:
            raise ConfigError(f"--skip: {exc}") from None
        return f(*args, spikes=spikes, skips=skips, **kwargs)
    for option in reversed(_OPTIONS):
        wrapper = option(wrapper)
    return wrapper  # type: ignore[return-value]


def check_spikes(spikes: dict[str, Any], *, checkpoint_every: int, keep_checkpoints: int | None,
                 on_nonfinite: str | None) -> None:
    """Refuse settings the coordinator would refuse, with the checkpoints they need (ConfigError naming the
    option), before any cluster starts."""
    given = {k: v for k, v in spikes.items() if v is not None}
    try:
        SpikeSettings.from_spec(pb.JobSpec(**given), checkpoint_every)
        check_settings(pb.JobSpec(**given, checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints or 0,
                                  on_nonfinite=on_nonfinite or ""))
    except ValueError as exc:
        option = next((k for k in SPIKE_FIELDS if k in str(exc)), "")
        raise ConfigError(f"--{option.replace('_', '-')}: {exc}" if option else str(exc)) from None


def describe_spike(d: dict[str, Any]) -> str:
    """The progress line of a ``job.spike`` or ``job.rolled_back`` event."""
    if d.get("event") == "job.rolled_back":
        first, last = (d.get("skipped_steps") or [0, 0])[:2]
        return (f"[magenta]rolled back[/magenta] from the spike at step {d.get('step')} to the cut at step "
                f"{d.get('cut')}, skipping the batches of steps {first}..{last - 1} (rollback {d.get('rollback')})")
    then = "rolling back" if d.get("action") == "rollback" else "the job goes on"
    return (f"[magenta]loss spike[/magenta] {d.get('metric')} {d.get('value')} at step {d.get('step')} "
            f"(baseline {d.get('baseline')}, threshold {d.get('threshold')}): {then}")


def describe_verification(d: dict[str, Any]) -> str:
    """The progress line of a ``job.verify_mismatch`` or ``job.sdc`` event (docs/integrity.md)."""
    steps = f"slice {d.get('slice')} steps {d.get('from_step')}..{d.get('to_step')}"
    if d.get("event") == "job.verify_mismatch":
        return (f"[red]verification mismatch[/red]: {steps} computed on {d.get('verifier')} differ from "
                f"{d.get('primary')}'s commit; a third worker decides")
    if d.get("verdict") == "convicted":
        return (f"[red]silent data corruption[/red]: worker {d.get('suspect')} computed {steps} wrong (the third "
                f"worker agrees with the other): cordoned suspect-sdc; the job goes back to the cut at step "
                f"{d.get('trusted_cut')} at most")
    return f"[yellow]verification mismatch not settled[/yellow] ({d.get('verdict')}): {steps}"
