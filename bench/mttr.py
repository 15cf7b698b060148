"""MTTR against its physical limit, by fault kind, and goodput under a fault every 10 s, in one run.

For each of ``kill`` (SIGKILL), ``hang`` (SIGSTOP for longer than the lease TTL) and
``partition`` (the worker's network cut: network namespaces as root, else proxies), one
chaos run of the pipeline example hits the worker of one stage mid-run, on a fresh
embedded cluster. Each recovery's MTTR by phase (``job.recovered``: detection, fencing,
remap, restore, replay, catch-up) is set against the **physical limit** computed from the
run's own numbers:

* detection floor: 0 for a kill (the socket closes), the leader's ``suspect_after_s``
  for a hang or a partition (nothing tells a silent worker from a slow one sooner);
* restore floor: the lost slice's state bytes / the memory bandwidth measured here
  (one large host copy);
* replay floor: the replayed instances of the slice that re-runs the most, times each
  node's median compute per instance in the same run (a slice's instances run one after
  another on its devices; slices replay in parallel).

Then a long run with a fault (kill, hang or partition, drawn from a seed) every
``--mtbf-s`` seconds on average: its goodput (device-seconds of first runs over all
device-seconds) and that it ends bitwise equal to the fault-free run.

Last, ``scenarios/straggler.toml`` (one stage's worker stopped for 0.1 s of every 0.2 s):
the seconds from the fault to the straggler watch's decision and to the slice running on
the spare, the drained slice's pause, and the instances re-run (0: a planned move).

Then detection on a busy host: ``--detect-runs`` hangs and as many partitions, each of one
stage's worker (the stages in turn), with ``--hogs`` processes spinning on the CPU beside the
cluster the whole time (a loaded host is the worst case a real host will not beat). Detection
here is the fault's injection to the leader's recovery opening (both wall clock), not the
recovery record's own ``detection`` phase (which counts from the worker's last event and so
includes any idle time before the fault); its distribution is printed.

Targets (issue "recovery time near the physical limit"): kill MTTR <= 0.5 s and <= 2x its
limit; hang MTTR <= TTL + 0.5 s; goodput >= 0.90 at one fault per 10 s; a straggler
detected and migrated within 5 s; beside the CPU hogs, a hang or partition detected within
``suspect_after_s + 0.5 s`` at the 90th percentile.
The table goes to stderr; the last stdout line is ``{"bench": "mttr", ...}``.
Before those, what the window of steps in flight costs a recovery: the same kill with each of
``--windows`` (default 2 and the leader's own, 0), side by side: the window the run had, the
instances replayed, the output logs' peak bytes, the MTTR and its replay phase.
Run: ``python bench/mttr.py`` (``make bench``); ``--repeats`` for medians; ``--only detection``
for the busy-host detection alone, ``--only window`` for the window's cost alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rallypoint.chaos.runner import run_scenario  # noqa: E402
from rallypoint.chaos.scenario import FaultSpec, RandomFaults, Scenario, load_scenario  # noqa: E402
from rallypoint.client.compile import compile_program, ensure_host_devices  # noqa: E402
from rallypoint.client.jobfile import load_program  # noqa: E402
from rallypoint.basics.logs import configure  # noqa: E402

JOB = ROOT / "examples" / "pipeline_mlp.py"
TTL_S = 2
SUSPECT_AFTER_S = 1.0  # the local cluster's default (--suspect-after-s)
KINDS = ("kill", "hang", "partition")


def memory_bandwidth_bytes_per_s(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Host memory bandwidth as one large copy sees it (the median of ``repeats``)."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def slice_state_bytes(compiled: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for st in compiled.states.values():
        leaves = jax.tree_util.tree_leaves(st.aval)
        out[st.slice] = out.get(st.slice, 0) + sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in leaves)
    return out


def scenario(name: str, steps: int, every: int, faults: tuple[FaultSpec, ...] = (), *, spares: int = 1,
             rnd: RandomFaults | None = None, bound_s: float = 300.0, window: int = 0) -> Scenario:
    return Scenario(name=name, description=f"bench/mttr.py: {name}", path=JOB, job_file=JOB, steps=steps,
                    checkpoint_every=every, workers=4, spares=spares, coordinators=1, lease_ttl_s=TTL_S,
                    faults=faults, random=rnd, time_bound_s=bound_s, window=window)


def window_cost(args: Any) -> tuple[list[dict[str, Any]], bool]:
    """What the window costs a recovery: a kill of ``--target``'s worker at ``--at`` with each window of
    ``--windows`` (0: the leader's), in turn, ``--repeats`` times: the window the run had, the instances
    replayed, the output logs' peak (bytes in memory and spilled, the most any worker held) and the MTTR."""
    rows, bitwise = [], True
    for _ in range(args.repeats):
        for asked in args.windows:
            fault = FaultSpec("kill", args.target, at_step=args.at)
            summary, _ = run_scenario(scenario(f"mttr-window-{asked}", args.steps, args.every, (fault,), window=asked),
                                      say=lambda _d: None)
            bitwise &= bool(summary["ok"])
            peak = summary.get("output_log_peak") or {}
            recs = summary["recoveries"]
            rows.append({"asked": asked, "window": summary.get("window"),
                         "replayed": sum(summary["replayed_instances"].values()),
                         "log_bytes": int(peak.get("memory_bytes", 0)) + int(peak.get("spilled_bytes", 0)),
                         "mttr_s": recs[0]["mttr_s"] if recs else None,
                         "replay_s": recs[0]["phases"].get("replay") if recs else None,
                         "wall_s": summary["outcome"]["wall_s"], "ok": bool(summary["ok"])})
    return rows, bitwise


def _print_window(rows: list[dict[str, Any]], args: Any) -> list[dict[str, Any]]:
    """The medians by window asked, one row each (stderr); returns them."""
    w = sys.stderr.write
    w(f"window cost: kill of {args.target} at step {args.at}, checkpoints every {args.every}, {args.steps} steps, "
      f"{args.repeats} runs each (medians)\n{'asked':>6}{'window':>8}{'replayed':>10}{'log peak B':>12}"
      f"{'MTTR s':>8}{'replay s':>10}{'wall s':>8}\n")
    out = []
    for asked in args.windows:
        mine = [r for r in rows if r["asked"] == asked]
        row = {"asked": asked, "window": mine[0]["window"],
               **{k: med([r[k] for r in mine if r[k] is not None]) for k in ("replayed", "log_bytes", "mttr_s",
                                                                             "replay_s", "wall_s")}}
        w(f"{'auto' if asked == 0 else asked:>6}{row['window']!s:>8}{row['replayed']:>10}{int(row['log_bytes']):>12}"
          f"{row['mttr_s']:>8}{row['replay_s']:>10}{row['wall_s']:>8}\n")
        out.append(row)
    return out


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else float("nan")


def straggler_move(summary: dict[str, Any]) -> dict[str, float | None]:
    """Seconds from a straggler fault to the watch's decision and to the move's end; the drain's pause and re-runs;
    how many healthy workers were moved as well (false moves, docs/elastic.md)."""
    (fault,) = [f for f in summary["faults"] if f["kind"] == "straggler"]
    at = {d["decision"]: d["at"] for d in summary["stragglers"] if d.get("worker") == fault["worker"]}
    drains = [d for d in summary["drains"] if d["reason"] == "straggler"]
    ours = [d for d in drains if d["worker"] == fault["worker"]]
    return {"decided_s": round(at["migrate"] - fault["at"], 3) if "migrate" in at else None,
            "migrated_s": round(at["migrated"] - fault["at"], 3) if "migrated" in at else None,
            "paused_s": ours[0]["paused_s"] if ours else None,
            "replayed_instances": sum(d["replayed_instances"] for d in drains) if drains else None,
            "false_moves": len(drains) - len(ours)}


def limit_of(rec: dict[str, Any], kind: str, node_slice: dict[str, str], instance_s: dict[str, float],
             state_bytes: dict[str, int], bandwidth: float) -> dict[str, float]:
    lost = [s for slices in rec["lost"].values() for s in slices]
    per_slice: dict[str, float] = {}
    for node, k in rec.get("planned_instances", {}).items():
        per_slice[node_slice[node]] = per_slice.get(node_slice[node], 0.0) + k * instance_s.get(node, 0.0)
    parts = {"detection": 0.0 if kind == "kill" else SUSPECT_AFTER_S,
             "restore": sum(state_bytes.get(s, 0) for s in lost) / bandwidth,
             "replay": max(per_slice.values(), default=0.0)}
    return {**parts, "total": sum(parts.values())}


def detections(summary: dict[str, Any]) -> tuple[list[float], int, int]:
    """Seconds from each hang or partition taking effect (the signal sent, the network cut) to the recovery that
    took its worker (wall clock); how many took effect and were never detected; how many the harness could not
    fire (its own etcd lookup of the target failed: nothing was injected)."""
    out, undetected, unfired = [], 0, 0
    for f in summary["faults"]:
        if f["kind"] not in ("hang", "partition"):
            continue
        if f.get("error") or not f.get("worker"):
            unfired += 1
            continue
        struck = f.get("detail", {}).get("struck_at", f["at"])
        opened = [r["detected_at"] for r in summary["recoveries"]
                  if f["worker"] in r["lost"] and r["detected_at"] >= struck]
        if opened:
            out.append(round(min(opened) - struck, 3))
        else:
            undetected += 1
    return out, undetected, unfired


def distribution(xs: list[float]) -> dict[str, float | int]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "min": min(xs), "p50": round(float(np.percentile(xs, 50)), 3),
            "p90": round(float(np.percentile(xs, 90)), 3), "max": max(xs)}


def detection_beside_hogs(runs: int, hogs: int, steps: int, every: int) -> tuple[dict[str, Any], bool]:
    """``runs`` hangs and ``runs`` partitions with ``hogs`` busy processes beside the cluster: the detection times,
    their distribution, and whether every run passed its invariants."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    seen: dict[str, list[float]] = {"hang": [], "partition": []}
    ok, missed, unfired = True, 0, 0
    try:
        for i in range(runs):
            for kind in seen:
                target = f"stage{i % 4}"
                fault = FaultSpec(kind, target, at_step=steps // 3, duration_s=3.0)
                summary, _ = run_scenario(scenario(f"detect-{kind}", steps, every, (fault,)), say=lambda _d: None)
                ok &= bool(summary["ok"])
                got, undetected, not_fired = detections(summary)
                missed, unfired = missed + undetected, unfired + not_fired
                seen[kind] += got
    finally:
        for p in spin:
            p.kill()
            p.wait()
    both = seen["hang"] + seen["partition"]
    return {"hogs": hogs, "runs": runs, "undetected": missed, "not_fired": unfired, "hang": distribution(seen["hang"]),
            "partition": distribution(seen["partition"]), "all": distribution(both), "samples": seen}, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=10, help="checkpoint every K steps")
    ap.add_argument("--at", type=int, default=43, help="the step at which the single faults hit")
    ap.add_argument("--target", default="stage2", help="the slice whose worker the single faults hit")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--goodput-steps", type=int, default=2000)
    ap.add_argument("--goodput-s", type=float, default=60.0, help="faults are drawn over this long")
    ap.add_argument("--mtbf-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--detect-runs", type=int, default=5, help="hangs (and as many partitions) beside the CPU hogs")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy processes beside the cluster")
    ap.add_argument("--only", choices=("detection", "window"), help="run only this part")
    ap.add_argument("--windows", type=int, nargs="+", default=[2, 0],
                    help="the window part: the windows compared (0: the leader's, from the checkpoint interval)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args()
    configure(level="error")
    ensure_host_devices(8)
    program = load_program(JOB, steps=args.steps)
    compiled = compile_program(program)
    node_slice = {n: spec.slice for n, spec in program.nodes.items()}
    state_bytes = slice_state_bytes(compiled)
    bandwidth = memory_bandwidth_bytes_per_s()
    quiet = lambda _d: None  # noqa: E731
    windows, windows_ok = window_cost(args)
    window_rows = _print_window(windows, args)
    if args.only == "window":
        print(json.dumps({"bench": "mttr", "steps": args.steps, "every": args.every, "at": args.at,
                          "window_cost": window_rows, "bitwise_equal": windows_ok}))
        return 1 if args.strict and not windows_ok else 0
    detect, detect_ok = detection_beside_hogs(args.detect_runs, args.hogs, 60, args.every)
    detect_met = detect["undetected"] == 0 and detect["all"].get("p90", float("inf")) <= SUSPECT_AFTER_S + 0.5
    _print_detection(detect)
    if args.only == "detection":
        print(json.dumps({"bench": "mttr", "suspect_after_s": SUSPECT_AFTER_S, "detection": detect,
                          "targets": {"detection_p90_le_suspect_plus_0.5s": detect_met}, "bitwise_equal": detect_ok}))
        return 1 if args.strict and not (detect_met and detect_ok) else 0

    rows: dict[str, dict[str, Any]] = {}
    bitwise = True
    for kind in KINDS:
        runs = []
        for _ in range(args.repeats):
            fault = FaultSpec(kind, args.target, at_step=args.at, duration_s=3.0 if kind != "kill" else 0.0)
            summary, _ = run_scenario(scenario(f"mttr-{kind}", args.steps, args.every, (fault,)), say=quiet)
            bitwise &= bool(summary["ok"])
            for rec in summary["recoveries"]:
                lim = limit_of(rec, kind, node_slice, summary["goodput"]["instance_s"], state_bytes, bandwidth)
                runs.append({"mttr": rec["mttr_s"], "phases": rec["phases"], "limit": lim,
                             "tiers": rec.get("restore_tiers", {})})
        rows[kind] = {
            "recoveries": len(runs), "mttr_s": med([r["mttr"] for r in runs]),
            "phases_s": {p: med([r["phases"].get(p, 0.0) for r in runs])
                         for p in ("detection", "fencing", "remap", "restore", "replay", "catch_up")},
            "limit_s": {p: med([r["limit"][p] for r in runs]) for p in ("detection", "restore", "replay", "total")},
            "restore_tiers": sorted({t for r in runs for t in r["tiers"].values()}),
        }
        rows[kind]["x_limit"] = round(rows[kind]["mttr_s"] / rows[kind]["limit_s"]["total"], 2) \
            if rows[kind]["limit_s"]["total"] else None

    rnd = RandomFaults(seed=args.seed, mtbf_s=args.mtbf_s, duration_s=args.goodput_s, kinds=KINDS,
                       targets=("stage0", "stage1", "stage2", "stage3"), fault_duration_s=3.0)
    long_run, _ = run_scenario(scenario("mttr-goodput", args.goodput_steps, args.every, spares=3, rnd=rnd,
                                        bound_s=600.0), say=quiet)
    goodput = long_run["goodput"]["goodput"]
    strag = []
    for _ in range(args.repeats):
        summary, _ = run_scenario(load_scenario(ROOT / "scenarios" / "straggler.toml"), say=quiet)
        bitwise &= bool(summary["ok"])
        strag.append(straggler_move(summary))
    out = {"bench": "mttr", "steps": args.steps, "every": args.every, "ttl_s": TTL_S, "suspect_after_s": SUSPECT_AFTER_S,
           "memory_gb_per_s": round(bandwidth / 1e9, 2), "state_bytes": state_bytes, "kinds": rows,
           "goodput": {"value": goodput, "faults": long_run["fired"], "recoveries": len(long_run["recoveries"]),
                       "wall_s": long_run["outcome"]["wall_s"], "ok": long_run["ok"],
                       "mttr_median_s": long_run["mttr_s"]["median"]},
           "straggler": {k: med([r[k] for r in strag if r[k] is not None]) for k in strag[0]},
           "detection": detect, "window_cost": window_rows,
           "bitwise_equal": bitwise and bool(long_run["ok"]) and detect_ok and windows_ok}
    kill, hang = rows["kill"], rows["hang"]
    out["targets"] = {
        "kill_mttr_le_0.5s": kill["mttr_s"] <= 0.5,
        "kill_mttr_le_2x_limit": kill["x_limit"] is not None and kill["x_limit"] <= 2.0,
        "hang_mttr_le_ttl_plus_0.5s": hang["mttr_s"] <= TTL_S + 0.5,
        "goodput_ge_0.90": goodput is not None and goodput >= 0.90,
        "straggler_migrated_le_5s": all(r["migrated_s"] is not None and r["migrated_s"] <= 5.0 for r in strag),
        "detection_p90_le_suspect_plus_0.5s": detect_met,
    }
    w = sys.stderr.write
    w(f"pipeline {args.steps} steps, checkpoints every {args.every}, fault at step {args.at} on {args.target}; "
      f"TTL {TTL_S} s, suspect after {SUSPECT_AFTER_S} s; memory {bandwidth / 1e9:.1f} GB/s\n")
    w(f"{'kind':10}{'MTTR s':>8}{'detect':>8}{'fence':>8}{'remap':>8}{'restore':>8}{'replay':>8}"
      f"{'limit s':>9}{'(det':>6}{'rest':>8}{'repl)':>7}{'x limit':>9}  tiers\n")
    for kind, r in rows.items():
        p, lim = r["phases_s"], r["limit_s"]
        w(f"{kind:10}{r['mttr_s']:>8}{p['detection']:>8}{p['fencing']:>8}{p['remap']:>8}{p['restore']:>8}"
          f"{p['replay']:>8}{lim['total']:>9}{lim['detection']:>6}{lim['restore']:>8.5f}{lim['replay']:>7}"
          f"{r['x_limit']!s:>9}  {','.join(r['restore_tiers'])}\n")
    g = out["goodput"]
    w(f"goodput {g['value']} over {g['wall_s']} s with faults {g['faults']} ({g['recoveries']} recoveries, MTTR median "
      f"{g['mttr_median_s']} s); every run passed its invariants (bitwise): {out['bitwise_equal']}\n")
    st = out["straggler"]
    w(f"straggler (stopped 0.1 s of every 0.2 s): decided after {st['decided_s']} s, on the spare after "
      f"{st['migrated_s']} s, paused {st['paused_s']} s, {st['replayed_instances']} instances re-run, "
      f"{st['false_moves']} healthy workers moved as well (median)\n")
    _print_detection(detect)
    _print_window(windows, args)
    w("targets: " + ", ".join(f"{k} {v}" for k, v in out["targets"].items()) + "\n")
    print(json.dumps(out))
    return 1 if args.strict and not (all(out["targets"].values()) and out["bitwise_equal"]) else 0


def _print_detection(d: dict[str, Any]) -> None:
    w = sys.stderr.write
    w(f"detection beside {d['hogs']} CPU hogs (fault injected -> recovery opened, s; suspect after {SUSPECT_AFTER_S} s, "
      f"target p90 <= {SUSPECT_AFTER_S + 0.5} s), {d['undetected']} faults never detected, {d['not_fired']} not fired "
      "(the harness's lookup of the target failed):\n")
    for kind in ("hang", "partition", "all"):
        r = d[kind]
        w(f"  {kind:10} n={r['n']}" + ("".join(f"  {k} {r[k]}" for k in ("min", "p50", "p90", "max")) if r["n"] else "")
          + "\n")
    w(f"  samples: {d['samples']}\n")


if __name__ == "__main__":
    sys.exit(main())
