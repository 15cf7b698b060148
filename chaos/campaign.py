"""Chaos campaigns: one scenario over many seeds, each a full run with every invariant.

A campaign runs :func:`rallypoint.chaos.runner.run_scenario` once per seed
``first_seed, first_seed + 1, ...``, each time with the scenario's ``[random]`` seed
replaced (so each seed draws another fault schedule), and sums the runs up in a table::

    OUT/
      campaign.json   the table as data: one row per seed, the totals, the failed
                      seeds with their report folders and kept log directories
      seed-<S>/       the report folder of seed S (summary.json, timeline.html),
                      kept only when S failed, unless ``keep_all``

The pure part (:func:`check_campaign`, :func:`seed_row`, :func:`totals`,
:func:`campaign_data`, :func:`format_campaign`, :func:`percentile`) works on plain
summary dicts as ``run_scenario`` returns them; :func:`run_campaign` is the loop that
runs the seeds and writes the folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rallypoint.chaos.scenario import Scenario
from rallypoint.basics.errors import ConfigError, RallypointError

CAMPAIGN_FILE = "campaign.json"

Runner = Callable[..., tuple[dict[str, Any], Path]]


# -- input ------------------------------------------------------------------------------------


def check_campaign(scenario: Scenario, seeds: int, out_dir: Path | None = None) -> None:
    """Refuse a campaign that cannot vary or has nothing to run, before anything is written.

    Raises:
        ConfigError: ``seeds`` < 1, a scenario without a ``[random]`` section, or an
            ``out_dir`` that already holds files; the message says what to do.
    """
    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {seeds}: pass how many seeds to run (e.g. --seeds 20)")
    if scenario.random is None:
        raise ConfigError(f"scenario {scenario.path} has no [random] section, so every seed would inject the same "
                          "faults: add one (seed, mtbf_s, duration_s, kinds) or use `rallypoint chaos run` for it")
    if out_dir is not None and Path(out_dir).exists() and (not Path(out_dir).is_dir() or any(Path(out_dir).iterdir())):
        raise ConfigError(f"--out {out_dir} already exists and is not an empty folder: pass a new folder "
                          "(a campaign does not write over an earlier one)")


def seed_list(first_seed: int, seeds: int) -> list[int]:
    """The seeds of a campaign: ``first_seed`` and the ``seeds - 1`` after it."""
    return list(range(first_seed, first_seed + seeds))


def default_out_dir(scenario_name: str, now: float | None = None) -> Path:
    """``chaos-reports/campaign-<scenario>-<time>``, beside the single runs' reports."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(now))
    return Path("chaos-reports") / f"campaign-{scenario_name}-{stamp}"


# -- the table (pure) -----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100.0 * len(ordered)) - 1)]


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def seed_row(seed: int, summary: dict[str, Any], report: Path | None = None,
             scheduled: int | None = None) -> dict[str, Any]:
    """One seed's line of the table, from the summary its run returned.

    ``scheduled`` is how many faults the seed's schedule holds: those the run never
    tried (the job ended first, or the harness was held up) are ``unfired``.
    """
    outcome = summary.get("outcome") or {}
    recoveries = summary.get("recoveries") or []
    mttrs = [float(r["mttr_s"]) for r in recoveries if r.get("mttr_s") is not None]
    tried = len(summary.get("faults") or [])
    return {
        "seed": seed,
        "ok": bool(summary.get("ok")),
        "state": outcome.get("state", "?"),
        "reason": outcome.get("reason", ""),
        "wall_s": outcome.get("wall_s"),
        "fired": dict(sorted((summary.get("fired") or {}).items())),
        "fault_errors": sum(1 for f in summary.get("faults") or [] if f.get("error")),
        "scheduled": scheduled,
        "unfired": max(0, scheduled - tried) if scheduled is not None else None,
        "resumes": len(summary.get("resumes") or []),
        "recoveries": len(recoveries),
        "mttrs_s": mttrs,
        "mttr_median_s": _median(mttrs),
        "mttr_max_s": round(max(mttrs), 4) if mttrs else None,
        "goodput": (summary.get("goodput") or {}).get("goodput"),
        "failed_invariants": [c["name"] for c in summary.get("invariants") or [] if not c.get("ok")],
        "report": str(report) if report is not None else None,
        "logs": summary.get("logs"),
    }


def error_row(seed: int, exc: BaseException, report: Path | None = None) -> dict[str, Any]:
    """The line of a seed whose run raised instead of returning a summary."""
    row = seed_row(seed, {"ok": False, "outcome": {"state": "error", "reason": f"{type(exc).__name__}: {exc}"}},
                   report)
    row["unfired"] = None
    row["failed_invariants"] = ["harness-error"]
    row["traceback"] = "".join(traceback.format_exception(exc))[-4000:]
    return row


def totals(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The campaign over all its seeds: passes, MTTR over every recovery, median goodput."""
    passed = sum(1 for r in rows if r["ok"])
    mttrs = [m for r in rows for m in r.get("mttrs_s") or []]
    goodputs = [r["goodput"] for r in rows if r.get("goodput") is not None]
    fired: Counter[str] = Counter()
    for r in rows:
        fired.update(r.get("fired") or {})
    failed_invariants: Counter[str] = Counter(n for r in rows for n in r.get("failed_invariants") or [])
    return {
        "seeds": len(rows), "passed": passed, "failed": len(rows) - passed,
        "pass_rate": round(passed / len(rows), 4) if rows else None,
        "faults_fired": dict(sorted(fired.items())),
        "fault_errors": sum(r.get("fault_errors", 0) for r in rows),
        "unfired": sum(r.get("unfired") or 0 for r in rows),
        "recoveries": sum(r.get("recoveries", 0) for r in rows),
        "mttr_s": {"median": _median(mttrs),
                   "p90": round(p, 4) if (p := percentile(mttrs, 90)) is not None else None,
                   "max": round(max(mttrs), 4) if mttrs else None},
        "goodput_median": _median(goodputs),
        "failed_invariants": dict(sorted(failed_invariants.items())),
    }


def campaign_data(scenario: str, scenario_file: str, seeds: Sequence[int], rows: Sequence[dict[str, Any]], *,
                  started_at: float, ended_at: float, out_dir: Path, complete: bool = True) -> dict[str, Any]:
    """What ``campaign.json`` holds."""
    return {
        "scenario": scenario, "scenario_file": scenario_file, "seeds": list(seeds),
        "started_at": started_at, "ended_at": ended_at, "wall_s": round(ended_at - started_at, 3),
        "out_dir": str(out_dir), "complete": complete,
        "ok": complete and all(r["ok"] for r in rows) and len(rows) == len(seeds),
        "rows": list(rows), "totals": totals(rows),
        "failed": [{"seed": r["seed"], "state": r["state"], "reason": r["reason"],
                    "failed_invariants": r["failed_invariants"], "report": r["report"], "logs": r["logs"]}
                   for r in rows if not r["ok"]],
    }


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fired(fired: dict[str, int], errors: int = 0, unfired: int | None = 0) -> str:
    parts = ([f"{k}:{n}" for k, n in sorted(fired.items())] + ([f"errors:{errors}"] if errors else [])
             + ([f"unfired:{unfired}"] if unfired else []))
    return " ".join(parts) or "-"


def format_campaign(data: dict[str, Any]) -> str:
    """The campaign as plain text: a header, one line per seed, the totals."""
    rows, t = data["rows"], data["totals"]
    header = ("seed", "result", "state", "wall_s", "faults fired", "recov", "mttr_med", "mttr_max", "goodput",
              "failed invariants")
    body = [(str(r["seed"]), "ok" if r["ok"] else "FAILED", r["state"], _num(r["wall_s"], ".1f"),
             _fired(r["fired"], r.get("fault_errors", 0), r.get("unfired")), str(r["recoveries"]), _num(r["mttr_median_s"], ".3f"),
             _num(r["mttr_max_s"], ".3f"), _num(r["goodput"], ".3f"), ",".join(r["failed_invariants"]) or "-")
            for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [f"campaign {data['scenario']}: {len(data['seeds'])} seeds "
             f"({data['seeds'][0]}..{data['seeds'][-1]}) in {data['wall_s']:.1f}s"
             + ("" if data.get("complete", True) else " (incomplete)"),
             fmt.format(*header).rstrip()]
    lines += [fmt.format(*b).rstrip() for b in body]
    m = t["mttr_s"]
    rate = None if t["pass_rate"] is None else t["pass_rate"] * 100
    lines += ["", f"{t['passed']} passed, {t['failed']} failed (pass rate {_num(rate, '.0f')}%)"
              f"  faults {_fired(t['faults_fired'], t['fault_errors'], t.get('unfired'))}  recoveries {t['recoveries']}",
              f"MTTR median {_num(m['median'], '.3f')}s  p90 {_num(m['p90'], '.3f')}s  max {_num(m['max'], '.3f')}s"
              f"  goodput median {_num(t['goodput_median'], '.3f')}"]
    for f in data["failed"]:
        lines.append(f"failed seed {f['seed']}: {f['state']} {f['reason'][:120]}".rstrip()
                     + f"; report {f['report'] or '-'}; logs {f['logs'] or '-'}")
    return "\n".join(lines)


# -- the loop ---------------------------------------------------------------------------------------


def write_campaign(out_dir: Path, data: dict[str, Any]) -> Path:
    """Write ``campaign.json`` atomically; return its path."""
    path = Path(out_dir) / CAMPAIGN_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def job_slices(scenario: Scenario) -> list[str] | None:
    """The slices of the scenario's job, which its random faults target; None if it does not load."""
    from rallypoint.client.compile import ensure_host_devices
    from rallypoint.client.jobfile import load_program

    try:
        ensure_host_devices(8)  # as run_scenario does, before the job file can touch JAX
        return list(load_program(scenario.job_file, steps=scenario.steps, settings=dict(scenario.settings)).slices)
    except RallypointError:
        return None  # each seed's run then fails with the reason


def run_campaign(scenario: Scenario, seeds: Sequence[int], out_dir: Path, *, keep_all: bool = False,
                 say: Callable[[dict[str, Any]], None] = lambda d: None,
                 runner: Runner | None = None) -> dict[str, Any]:
    """Run ``scenario`` once per seed and write the campaign folder; return ``campaign.json``'s data.

    Each seed's run reports into ``out_dir/seed-<S>``; the folder of a seed that passed
    is removed afterwards unless ``keep_all``. A run that raises counts as a failed seed
    (``harness-error``) and the campaign goes on. ``campaign.json`` is rewritten after
    every seed (``complete`` false until the last), so a long soak can be watched.
    """
    if scenario.random is None:
        raise ConfigError(f"scenario {scenario.path} has no [random] section; a campaign varies its seed")
    if runner is None:  # imported before anything is written: a broken install writes no folder
        from rallypoint.chaos.runner import run_scenario as runner
    slices = job_slices(scenario)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        seeded = scenario.with_seed(seed)
        assert seeded.seed == seed
        folder = out_dir / f"seed-{seed}"
        say({"event": "chaos.campaign.seed_start", "seed": seed})
        try:
            summary, folder = runner(seeded, out_dir=folder, say=lambda d, seed=seed: say({**d, "seed": seed}))
            row = seed_row(seed, summary, folder, None if slices is None else len(seeded.schedule(slices)))
        except Exception as exc:  # noqa: BLE001 - one broken seed is a finding, not the end of the soak
            row = error_row(seed, exc, folder if folder.exists() else None)
        if row["ok"] and not keep_all:
            shutil.rmtree(folder, ignore_errors=True)
            row["report"] = None
        rows.append(row)
        say({"event": "chaos.campaign.seed", **{k: v for k, v in row.items() if k != "traceback"}})
        write_campaign(out_dir, campaign_data(scenario.name, str(scenario.path), seeds, rows, started_at=started,
                                              ended_at=time.time(), out_dir=out_dir,
                                              complete=len(rows) == len(seeds)))
    data = campaign_data(scenario.name, str(scenario.path), seeds, rows, started_at=started, ended_at=time.time(),
                         out_dir=out_dir)
    write_campaign(out_dir, data)
    return data
