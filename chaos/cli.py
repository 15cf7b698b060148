"""The chaos commands: ``run SCENARIO.toml``, ``campaign SCENARIO.toml --seeds N`` and ``report DIR``."""

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
    from rallypoint.basics.logs import configure

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


@chaos.command("campaign")
@click.argument("scenario_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--seeds", "n_seeds", type=int, required=True, help="How many seeds to run (one full run each).")
@click.option("--first-seed", type=int, default=None,
              help="The first seed; the others follow it (default: the scenario's [random] seed).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Campaign folder (default: chaos-reports/campaign-<scenario>-<time>).")
@click.option("--keep-all", is_flag=True, help="Keep the report folders of the seeds that passed too.")
@click.option("--json", "as_json", is_flag=True, help="One JSON event per line; the last is campaign.json's data.")
def campaign(scenario_file: Path, n_seeds: int, first_seed: int | None, out_dir: Path | None, keep_all: bool,
             as_json: bool) -> None:
    """Run SCENARIO_FILE once per seed, every invariant each time; print the table; exit 1 if a seed failed."""
    from rallypoint.chaos.campaign import (CAMPAIGN_FILE, check_campaign, default_out_dir, format_campaign,
                                           run_campaign, seed_list)
    from rallypoint.chaos.scenario import load_scenario
    from rallypoint.basics.errors import ConfigError
    from rallypoint.basics.logs import configure

    configure(level="warning")
    if not scenario_file.is_file():
        raise ConfigError(f"scenario file {scenario_file} does not exist: pass the path of a scenario TOML "
                          "(e.g. scenarios/campaign.toml)")
    scenario = load_scenario(scenario_file)
    check_campaign(scenario, n_seeds, out_dir)
    assert scenario.random is not None
    seeds = seed_list(scenario.random.seed if first_seed is None else first_seed, n_seeds)
    out = out_dir or default_out_dir(scenario.name)

    def say(d: dict[str, Any]) -> None:
        if as_json:
            click.echo(json.dumps(d))
        elif d.get("event") == "chaos.campaign.seed_start":
            click.echo(f"== seed {d['seed']}")
        elif d.get("event") == "chaos.fault":
            click.echo(f"  fault {d['kind']} {d.get('target') or ''} at step {d['step']}: "
                       f"{d.get('error') or 'fired on ' + str(d.get('worker') or '')}")
        elif d.get("event") == "chaos.campaign.seed":
            click.echo(f"  seed {d['seed']}: {'ok' if d['ok'] else 'FAILED'} {d['state']} in {d['wall_s']}s"
                       + (f"; failed: {', '.join(d['failed_invariants'])}" if d["failed_invariants"] else ""))

    data = run_campaign(scenario, seeds, out, keep_all=keep_all, say=say)
    if as_json:
        click.echo(json.dumps({"event": "chaos.campaign", **data}))
    else:
        click.echo(format_campaign(data))
        click.echo(f"campaign: {out / CAMPAIGN_FILE}")
    if not data["ok"]:
        failed = ", ".join(str(f["seed"]) for f in data["failed"])
        click.echo(f"error: {len(data['failed'])} of {len(seeds)} seeds failed ({failed}); their reports and logs "
                   f"are listed in {out / CAMPAIGN_FILE}", err=True)
        sys.exit(1)


@chaos.command("report")
@click.argument("directory", type=click.Path(path_type=Path))
def report(directory: Path) -> None:
    """Print the report of a chaos run as a table."""
    from rallypoint.chaos.report import format_table, load_report

    click.echo(format_table(load_report(directory)))
