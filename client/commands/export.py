"""``rallypoint export JOB``: a run's committed state as a plain Orbax checkpoint of the user's own tree.

The run is found as ``rallypoint plot`` finds it (:func:`rallypoint.client.commands.plot.find_run`):
``--checkpoint-dir`` (the checkpoint root the job ran with), ``--cluster`` (the job's record names
its run directory) or ``--state-dir`` (the checkpoint root of the cluster ``rallypoint up`` or
``rallypoint run`` kept there). The export itself is :func:`rallypoint.client.weights.export_run`;
docs/checkpoints.md ("Weights out") describes what it writes.

Added to the ``rallypoint`` group by :mod:`rallypoint.client.commands.main`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click

from rallypoint.basics.errors import ConfigError
from rallypoint.client.commands.clusters import cluster_options


@click.command("export")
@cluster_options
@click.argument("job")
@click.option("--run", default="", help="The run id (default: the newest run, LATEST).")
@click.option("--step", type=int, default=None,
              help="A committed step (default: the newest step every slice committed: the final cut once the job "
              "ended).")
@click.option("--state", "state", default=None, help="Export this state alone (default: the job's one state, or a "
              "dict of state name -> tree when it has several).")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="The folder to write (absent or empty; --force replaces what is in it).")
@click.option("--force", is_flag=True, help="Replace what --out holds.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The checkpoint root the job ran with (default: the --state-dir cluster's, or the one the "
              "job's record names).")
@click.option("--json", "as_json", is_flag=True, help="What was written, as one JSON object.")
def export(state_dir: Path, cluster: str | None, job: str, run: str, step: int | None, state: str | None, out: Path,
           force: bool, checkpoint_dir: Path | None, as_json: bool) -> None:
    """Write a committed state of JOB's run to --out as a plain Orbax checkpoint of the job's own tree
    (<out>/<step>/default), readable with Orbax alone or rallypoint.client.load_state."""
    from rallypoint.client.commands.plot import find_run
    from rallypoint.client.weights import describe, export_run

    if step is not None and step < 0:
        raise ConfigError(f"--step must be a committed step (>= 0), got {step}")
    found = find_run(job, run=run, checkpoint_dir=checkpoint_dir, state_dir=state_dir, cluster=cluster)
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes on the worker-written steps it reads: noise here
    manifest = export_run(found.path.parent, out, step=step, state=state, force=force)
    click.echo(json.dumps(manifest) if as_json else describe(manifest))
