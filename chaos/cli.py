"""``rallypoint chaos run SCENARIO.toml`` and ``rallypoint chaos report DIR``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click


@click.group()
def chaos() -> None:
    """Run chaos scenarios (real faults on an embedded cluster) and read their reports."""


@chaos.command("run")
@click.argument("scenario_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--seed", type=int, default=None, help="Seed of the random faults (default: the scenario's).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Report folder (default: chaos-reports/<scenario>-<time>).")
@click.option("--json", "as_json", is_flag=True, help="One JSON event per line; the last is the summary.")
def run(scenario_file: Path, seed: int | None, out_dir: Path | None, as_json: bool) -> None:
    """Run SCENARIO_FILE's job under its faults and check the invariants; exit 1 if one fails."""
    from rallypoint.chaos.report import format_table
    from rallypoint.chaos.runner import run_scenario
    from rallypoint.chaos.scenario import load_scenario
    from rallypoint.etcd.logs import configure

    configure(level="warning")
    scenario = load_scenario(scenario_file)
    if seed is not None:
        scenario = scenario.with_seed(seed)

    def say(d: dict[str, Any]) -> None:
        if as_json:
            click.echo(json.dumps(d))
        elif d.get("event") == "chaos.fault":
            click.echo(f"fault {d['kind']} {d.get('target') or ''} at step {d['step']}: "
                       f"{d.get('error') or 'fired on ' + str(d.get('worker') or '')}")
        elif d.get("event") in ("chaos.recovered", "chaos.resume", "chaos.healed"):
            click.echo(" ".join(f"{k}={v}" for k, v in d.items()))

    summary, folder = run_scenario(scenario, out_dir=out_dir, say=say)
    if as_json:
        click.echo(json.dumps({"event": "chaos.summary", "report": str(folder),
                               **{k: v for k, v in summary.items() if k != "progress"}}))
    else:
        click.echo(format_table(summary))
        click.echo(f"report: {folder}")
    if not summary["ok"]:
        failed = [c["name"] for c in summary["invariants"] if not c["ok"]]
        click.echo(f"error: invariants failed: {', '.join(failed)} (evidence in {folder / 'summary.json'})", err=True)
        sys.exit(1)


@chaos.command("report")
@click.argument("directory", type=click.Path(path_type=Path))
def report(directory: Path) -> None:
    """Print the report of a chaos run as a table."""
    from rallypoint.chaos.report import format_table, load_report

    click.echo(format_table(load_report(directory)))
