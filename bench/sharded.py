"""Sharded state benchmark: the LM example's FSDP variant against its replicated one, side by side in one run.

1. **Memory** (in process, 4 CPU devices): each state's exported ``init`` run on the slice's
   mesh, the bytes every device holds (``addressable_shards``), ``fsdp`` against ``dp``
   (replicated); and XLA's ``compiled.memory_analysis()`` of the init and of the train step
   (arguments, outputs, temporaries: per device). Target: sharded <= replicated / 4 (about).
2. **Speed**: steps/s of the ``fsdp`` program on an embedded cluster (one worker of 4
   devices) against a plain ``jax.jit`` loop of the same train function in this process,
   with the same shardings (the state's specs, the batch on "data") on 4 devices, its state
   donated, fed by the same host source. Medians of ``--repeats``; the first ``--skip``
   steps (compiling) left out. Target: cluster >= 0.95 x plain, at a step of >= 0.2 s.
3. **MTTR**: one SIGKILL of the slice's worker at ``--kill-at``, the slice restored on a spare
   of 4 devices from the last checkpoint, ``fsdp`` against ``dp``: MTTR and its phases
   (``job.recovered``), medians of ``--repeats``. Target: sharded no worse than replicated.

Sizes are the example's ``LM_*`` variables (examples/lm/README.md); the defaults here make a
step of about 0.3 s on the 2-core CPU box. The table goes to stderr; the last stdout line is
``{"bench": "sharded", ...}``. Run: ``python bench/sharded.py`` (``make bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rallypoint.client.compile import ensure_host_devices  # noqa: E402

ensure_host_devices(8)  # as bench/lm.py (imported below) asks; the slices use 4

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bench.lm import lm_program, steady  # noqa: E402
from rallypoint.basics.logs import configure  # noqa: E402
from rallypoint.client.commands.faults import Fault, FaultInjector  # noqa: E402
from rallypoint.client.compile import CompiledProgram, compile_program, slice_mesh  # noqa: E402
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig  # noqa: E402
from rallypoint.orchestrator.job.recovery import PHASES  # noqa: E402
from rallypoint.workers.programs import load_exported  # noqa: E402

SIZES = {"LM_LAYERS": "4", "LM_D_MODEL": "256", "LM_HEADS": "8", "LM_CONTEXT": "128", "LM_BATCH": "16",
         "LM_DEVICES": "4"}
"""The default sizes (an ``LM_*`` variable already set wins): about 3.3 M weights, 40 MB of state replicated."""


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- 1. memory -----------------------------------------------------------------------------------------------


def memory_stats(stats: Any) -> dict[str, int] | None:
    if stats is None:
        return None
    return {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp")}


def memory(compiled: CompiledProgram) -> dict[str, Any]:
    """Per-device bytes of the states born from their exported inits, and XLA's memory analysis."""
    mesh = slice_mesh(compiled.program, next(iter(compiled.program.slices)))
    total, held = 0, defaultdict(int)
    init_stats: dict[str, Any] = {}
    for name, st in compiled.states.items():
        init = load_exported(st.exported_init, mesh)
        for leaf in init():
            total += leaf.nbytes
            for shard in leaf.addressable_shards:
                held[str(shard.device)] += shard.data.nbytes
        init_stats[name] = memory_stats(init.lower().compile().memory_analysis())
    train = compiled.nodes["train"]
    avals = [compiled.states["params"].aval, compiled.states["opt_state"].aval,
             *(compiled.nodes["batch"].out_avals[o] for o in ("inputs", "targets"))]
    flat = [leaf for a in avals for leaf in jax.tree_util.tree_leaves(a)]
    step_stats = memory_stats(load_exported(train.exported, mesh).lower(*flat).compile().memory_analysis())
    return {"state_bytes": total, "per_device_bytes": dict(held), "max_per_device_bytes": max(held.values()),
            "init_memory": init_stats, "step_memory": step_stats}


# -- 2. speed ------------------------------------------------------------------------------------------------


def plain_loop(compiled: CompiledProgram, steps: int) -> list[float]:
    """The train function under ``jax.jit`` with the program's shardings and its state donated: step end times."""
    program = compiled.program
    mesh = slice_mesh(program, next(iter(program.slices)))

    def laid(state: str) -> Any:
        st = compiled.states[state]
        return st.tree.unflatten([NamedSharding(mesh, s) for s in st.specs])

    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    shard = {"params": laid("params"), "opt_state": laid("opt_state")}
    params = jax.jit(program.states["params"].init, out_shardings=shard["params"])()
    opt_state = jax.jit(program.states["opt_state"].init, out_shardings=shard["opt_state"])()
    train = jax.jit(program.nodes["train"].fn, in_shardings=(shard["params"], shard["opt_state"], data, data),
                    out_shardings={**shard, "loss": rep, "tokens": rep}, donate_argnums=(0, 1))
    source = program.nodes["batch"].fn

    def batch(step: int) -> tuple[Any, Any]:
        b = source(step, 0)
        return jax.device_put(b["inputs"], data), jax.device_put(b["targets"], data)

    times: list[float] = []
    x, y = batch(0)
    for s in range(steps):
        out = train(params, opt_state, x, y)
        params, opt_state = out["params"], out["opt_state"]
        if s + 1 < steps:
            x, y = batch(s + 1)
        float(out["loss"])  # the metric each step, as the cluster reports it
        times.append(time.perf_counter())
    return times


def start_cluster(spares: int) -> LocalCluster:
    state_dir = Path(tempfile.mkdtemp(prefix="rallypoint-bench-sharded-"))
    return LocalCluster.start(LocalClusterConfig(state_dir=state_dir, workers=1, spares=spares, devices_per_worker=4,
                                                 coordinators=1))


def cluster_rate(lc: LocalCluster, compiled: CompiledProgram, skip: int, new_run: bool) -> tuple[float, float]:
    """Steps/s of one run, and the seconds per step the worker spent running the train node (its compute)."""
    from rallypoint.client.submission import submit

    times: list[float] = []
    result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, window=2, new_run=new_run,
                    on_step=lambda s, m: times.append(time.perf_counter()))
    return steady(times, skip), result.recovery.get("compute_s", {}).get("train", float("nan")) / len(times)


# -- 3. MTTR -------------------------------------------------------------------------------------------------


def one_kill(lc: LocalCluster, compiled: CompiledProgram, kill_at: int, every: int) -> dict[str, Any]:
    from rallypoint.client.submission import submit

    name = next(iter(compiled.program.slices))
    injector = FaultInjector([Fault(name, name, kill_at)], lc.endpoints, lc.keys.cluster)
    result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, on_event=injector.on_event,
                    checkpoint_every=every, new_run=True)
    (r,) = result.recovery["recoveries"]
    return {"mttr_s": r["mttr_s"], "phases": r["phases"], "digest": result.state_digest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="steps of the speed runs")
    ap.add_argument("--skip", type=int, default=3, help="steps left out of the rate (compilation)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kill-steps", type=int, default=16, help="steps of each MTTR run")
    ap.add_argument("--kill-at", type=int, default=11)
    ap.add_argument("--every", type=int, default=5, help="checkpoint interval of the MTTR runs")
    ap.add_argument("--kill-repeats", type=int, default=3)
    args = ap.parse_args()
    configure(level="warning")
    for k, v in SIZES.items():
        os.environ.setdefault(k, v)

    compiled = {v: compile_program(lm_program(args.steps, v)) for v in ("dp", "fsdp")}
    out: dict[str, Any] = {"bench": "sharded", "sizes": {k: v for k, v in sorted(os.environ.items())
                                                         if k.startswith("LM_") and k != "LM_VARIANT"}}
    table: list[tuple[str, str]] = []

    mem = {v: memory(c) for v, c in compiled.items()}
    ratio = mem["fsdp"]["max_per_device_bytes"] / mem["dp"]["max_per_device_bytes"]
    out["memory"] = mem | {"sharded_over_replicated": round(ratio, 4), "target_met": ratio <= 0.26}
    table.append(("state bytes (total)", f"{mem['dp']['state_bytes']:,}"))
    for v in ("dp", "fsdp"):
        m = mem[v]
        init = {k: sum(s[k] for s in m["init_memory"].values() if s) for k in ("output", "temp")}
        step = m["step_memory"] or {}
        table.append((f"{v}: per device", f"{m['max_per_device_bytes']:,} B; XLA init out {init['output']:,} "
                                          f"temp {init['temp']:,}; step args {step.get('argument', 0):,} "
                                          f"out {step.get('output', 0):,} temp {step.get('temp', 0):,}"))
    table.append(("  sharded / replicated", f"{ratio:.3f}  (target <= 1/4)"))

    # Speed: the plain loop and the cluster in turns (the load of this host varies), on a cluster with no spare
    # (a spare compiles the job's programs ahead, on the same cores).
    plain, rates, compute = [], [], []
    lc = start_cluster(spares=0)
    try:
        for r in range(args.repeats):
            plain.append(steady(plain_loop(compiled["fsdp"], args.steps), args.skip))
            rate, per_step = cluster_rate(lc, compiled["fsdp"], args.skip, new_run=r > 0)
            rates.append(rate)
            compute.append(per_step)
    finally:
        lc.stop()
    lc = start_cluster(spares=2 * args.kill_repeats)
    try:
        kills: dict[str, list[dict[str, Any]]] = {v: [] for v in ("dp", "fsdp")}
        killed = {v: compile_program(lm_program(args.kill_steps, v)) for v in kills}
        for _ in range(args.kill_repeats):  # in turns: the load of this host varies
            for v in kills:
                kills[v].append(one_kill(lc, killed[v], args.kill_at, args.every))
    finally:
        lc.stop()
    p, c = median(plain), median(rates)
    out["speed"] = {"plain_steps_per_s": round(p, 4), "cluster_steps_per_s": round(c, 4),
                    "plain_step_s": round(1 / p, 4), "cluster_over_plain": round(c / p, 4),
                    "target_met": c / p >= 0.95 and 1 / p >= 0.2, "plain_runs": [round(x, 4) for x in plain],
                    "cluster_runs": [round(x, 4) for x in rates],
                    "cluster_train_compute_s_per_step": round(median(compute), 4)}
    table.append(("fsdp plain jit loop", f"{p:.3f} steps/s ({1 / p:.3f} s/step)"))
    table.append(("fsdp cluster", f"{c:.3f} steps/s ({c / p:.3f} x plain; target >= 0.95)"))
    table.append(("  train node's compute", f"{median(compute):.3f} s/step on the worker (all steps, compile included)"))

    out["mttr"] = {}
    for v in ("dp", "fsdp"):
        ks = kills[v]
        out["mttr"][v] = {"mttr_median_s": round(median([k["mttr_s"] for k in ks]), 4),
                          "mttr_runs_s": [round(k["mttr_s"], 4) for k in ks],
                          "phases_median_s": {ph: round(median([k["phases"][ph] for k in ks if ph in k["phases"]]), 4)
                                              for ph in PHASES},
                          "same_digest": len({k["digest"] for k in ks}) == 1}
        m = out["mttr"][v]
        table.append((f"MTTR {v}", f"{m['mttr_median_s']:.3f} s  " + " ".join(
            f"{ph} {s:.3f}" for ph, s in m["phases_median_s"].items())))
    mr = out["mttr"]["fsdp"]["mttr_median_s"] / out["mttr"]["dp"]["mttr_median_s"]
    out["mttr"]["sharded_over_replicated"] = round(mr, 4)
    table.append(("  sharded / replicated", f"{mr:.3f}  (target <= 1)"))
    for k, v in table:
        print(f"{k:>24}  {v}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
