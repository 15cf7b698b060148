"""Elastic benchmark: the pause of a drained slice against the MTTR of a kill of the same slice, in one run.

The 4-stage pipeline example (heavier stages than the default) trains on a fresh
embedded cluster per run (4 workers, one spare, checkpoints every ``--every`` steps).
For each slice of ``--slices``, one run drains its worker at ``--at`` (as
``rallypoint drain`` does) and one SIGKILLs it at the same step. Reported side by
side, medians over ``--repeats``:

* drain: the slice's pause (its last instance before the drain step to the spare's
  first instance), split into save (the checkpoint off the schedule) and move (load
  on the spare, rewire), and the instances re-run (target: 0);
* kill: the MTTR (detection to the lost work redone) and the instances re-run;
* the ratio pause / MTTR, and that every run ends with the fault-free state digest.

The last stdout line is one JSON object ``{"bench": "elastic", ...}``; the table goes to
stderr. Run: ``python bench/elastic.py`` (``make bench``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rallypoint.client.compile import ensure_host_devices  # noqa: E402

ensure_host_devices(8)

from bench.dispatch import pipeline_args, pipeline_module  # noqa: E402
from rallypoint.client.compile import compile_program  # noqa: E402
from rallypoint.client.commands.faults import Fault, FaultInjector  # noqa: E402
from rallypoint.client.submission import submit  # noqa: E402
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig  # noqa: E402
from rallypoint.basics.logs import configure  # noqa: E402


def one_run(compiled: Any, faults: list[Fault], every: int) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="rallypoint-bench-elastic-"))
    lc = LocalCluster.start(LocalClusterConfig(state_dir=state, workers=4, spares=1, devices_per_worker=1,
                                               coordinators=1))
    try:
        injector = FaultInjector(faults, lc.endpoints, lc.keys.cluster)
        result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, on_event=injector.on_event,
                        checkpoint_every=every)
    finally:
        lc.stop()
    errors = [f["error"] for f in injector.fired if "error" in f]
    if errors:
        raise SystemExit(f"a fault did not fire: {errors}")
    rec = result.recovery
    return {"digest": result.state_digest, "wall_s": result.wall_s, "drains": rec.get("drains", []),
            "recoveries": rec.get("recoveries", []), "replayed": sum(rec.get("replayed_instances", {}).values())}


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pipeline_args(ap)
    ap.add_argument("--slices", default="stage1,stage2", help="the slices whose worker is drained, then killed")
    ap.add_argument("--at", type=int, default=27, help="the step of the drain and of the kill")
    args = ap.parse_args()
    configure(level="error")
    compiled = compile_program(pipeline_module().build(steps=args.steps, width=args.width,
                                                       microbatch_size=args.microbatch_size))
    reference = one_run(compiled, [], args.every)["digest"]
    out: dict[str, Any] = {"bench": "elastic", "steps": args.steps, "every": args.every, "at": args.at,
                           "repeats": args.repeats, "slices": {}}
    digests = {reference}
    for s in args.slices.split(","):
        drains, kills = [], []
        for _ in range(args.repeats):
            drains.append(one_run(compiled, [Fault(s, s, args.at, "drain")], args.every))
            kills.append(one_run(compiled, [Fault(s, s, args.at, "kill")], args.every))
        digests |= {r["digest"] for r in drains + kills}
        d = [x for r in drains for x in r["drains"] if x["state"] == "done"]
        k = [x for r in kills for x in r["recoveries"] if x.get("mttr_s") is not None]
        row = {
            "drain_paused_s": median([x["paused_s"] for x in d if x["paused_s"] is not None]),
            "drain_save_s": median([x["save_s"] for x in d if x["save_s"] is not None]),
            "drain_move_s": median([x["move_s"] for x in d if x["move_s"] is not None]),
            "drain_replayed_instances": max(r["replayed"] for r in drains),
            "drain_recoveries": sum(len(r["recoveries"]) for r in drains),
            "kill_mttr_s": median([x["mttr_s"] for x in k]),
            "kill_replayed_instances": median([float(r["replayed"]) for r in kills]),
            "drain_wall_s": median([r["wall_s"] for r in drains]), "kill_wall_s": median([r["wall_s"] for r in kills]),
        }
        p, m = row["drain_paused_s"], row["kill_mttr_s"]
        row["pause_to_mttr"] = round(p / m, 4) if p is not None and m else None
        out["slices"][s] = row
    out["bitwise_equal"] = len(digests) == 1
    out["target_zero_replay_met"] = all(r["drain_replayed_instances"] == 0 and r["drain_recoveries"] == 0
                                        for r in out["slices"].values())
    w = sys.stderr.write
    w(f"pipeline {args.steps} steps, width {args.width}, checkpoints every {args.every}; drain vs kill at step "
      f"{args.at}; {args.repeats} repeat(s), medians\n")
    cols = ("drain_paused_s", "drain_save_s", "drain_move_s", "drain_replayed_instances", "kill_mttr_s",
            "kill_replayed_instances", "pause_to_mttr")
    w(f"{'slice':8}" + "".join(f"{c:>26}" for c in cols) + "\n")
    for s, row in out["slices"].items():
        w(f"{s:8}" + "".join(f"{row[c]!s:>26}" for c in cols) + "\n")
    w(f"drains replayed nothing: {out['target_zero_replay_met']}; every run bitwise equal: {out['bitwise_equal']}\n")
    print(json.dumps(out))
    ok = out["target_zero_replay_met"] and out["bitwise_equal"]
    return 0 if ok or not args.strict else 1


if __name__ == "__main__":
    sys.exit(main())
