"""Leader-loss benchmark: goodput and wall time through a killed and a hung leader, with and without the compilation cache.

Runs the chaos scenarios ``leader-kill`` and ``leader-hang`` (the 4-stage pipeline, two
coordinators; the leader is SIGKILLed at step 12, or SIGSTOPped past its lease) through
the chaos runner, each with the workers' persistent compilation cache on (the default)
and off, ``--repeats`` times, interleaved so both see the same machine. Nobody resumes
the job: the new leader adopts it (every slice reloads from the newest consistent cut).

Reported per scenario and cache setting (medians): goodput (device-seconds of first
runs over all device-seconds spent, the chaos report's), wall time and its ratio to the
fault-free in-process run, and whether every run passed every invariant with zero
resumes. Target: goodput >= 0.85 with the cache.

The last stdout line is one JSON object ``{"bench": "leader", ...}``; the table goes to
stderr. Run: ``python bench/leader.py [--repeats 3]`` (``make bench``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rallypoint.chaos.runner import run_scenario  # noqa: E402
from rallypoint.chaos.scenario import load_scenario  # noqa: E402
from rallypoint.basics.logs import configure  # noqa: E402

SCENARIOS = ("leader-kill", "leader-hang")
TARGET = 0.85


def one_run(name: str, cache: bool) -> dict[str, Any]:
    scenario = dataclasses.replace(load_scenario(ROOT / "scenarios" / f"{name}.toml"), compile_cache=cache)
    out = Path(tempfile.mkdtemp(prefix=f"rallypoint-bench-leader-{name}-"))
    summary, _ = run_scenario(scenario, out_dir=out / "report", say=lambda _d: None)
    g = summary["goodput"]
    return {"ok": bool(summary["ok"]) and summary["resumes"] == [], "goodput": g["goodput"],
            "wall_s": summary["outcome"]["wall_s"], "fault_free_wall_s": g["fault_free_wall_s"],
            "resumes": len(summary["resumes"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    configure(level="error")
    runs: dict[tuple[str, bool], list[dict[str, Any]]] = {(s, c): [] for s in SCENARIOS for c in (True, False)}
    for _ in range(args.repeats):
        for s in SCENARIOS:
            for cache in (True, False):
                runs[(s, cache)].append(one_run(s, cache))
    rows = []
    for (s, cache), rs in runs.items():
        rows.append({"scenario": s, "compile_cache": cache, "runs": len(rs), "all_ok": all(r["ok"] for r in rs),
                     "goodput_median": statistics.median(r["goodput"] for r in rs),
                     "goodput_min": min(r["goodput"] for r in rs),
                     "wall_s_median": statistics.median(r["wall_s"] for r in rs),
                     "wall_vs_fault_free": statistics.median(r["wall_s"] / r["fault_free_wall_s"] for r in rs)})
    print(f"{'scenario':<12} {'cache':<6} {'runs':>4} {'ok':<5} {'goodput med':>11} {'min':>6} {'wall s':>7} "
          f"{'x fault-free':>12}", file=sys.stderr)
    for r in rows:
        print(f"{r['scenario']:<12} {'on' if r['compile_cache'] else 'off':<6} {r['runs']:>4} {str(r['all_ok']):<5} "
              f"{r['goodput_median']:>11.3f} {r['goodput_min']:>6.3f} {r['wall_s_median']:>7.2f} "
              f"{r['wall_vs_fault_free']:>12.2f}", file=sys.stderr)
    met = all(r["all_ok"] and r["goodput_median"] >= TARGET for r in rows if r["compile_cache"])
    print(json.dumps({"bench": "leader", "target_goodput": TARGET, "target_met": met, "rows": rows,
                      "runs": {f"{s}/{'cache' if c else 'no-cache'}": v for (s, c), v in runs.items()}}))


if __name__ == "__main__":
    main()
