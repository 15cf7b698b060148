"""LM benchmark: the LM example's tokens/s on the embedded cluster against a plain in-process loop.

Reports, side by side in one run (medians of ``--repeats``; steady state: the first
``--skip`` steps, which compile, are left out):

1. **plain loop** (``--variant dp`` only): the example's own train step (the program's
   ``train`` node function) under ``jax.jit`` with its state donated, on the same number
   of devices laid out the same way (weights replicated, the batch sharded on "data"),
   fed by the same Grain host source (``lm_batch``) called in this process; the next
   step's batch is read while the device runs the current one. No Rallypoint.
2. **reference**: the in-process reference executor on the program (the exported nodes run
   one after another, values kept on the devices, a step's metrics read once the next
   step is dispatched, as a worker runs them).
3. **cluster**: the program on an embedded local cluster (``dp``: one worker of
   ``LM_DEVICES`` devices; ``pipeline``: two workers of two), the host source run by
   the workers, in their source processes.

After the cluster runs, the wall time of ``rallypoint export`` of the last run's newest committed state
(``client/weights.py``: read, checked against its commits, rebuilt as the job's tree, written as plain Orbax;
median of ``--repeats``). Also the seconds the host source took per step (plain loop: in this process, synchronous
with the step's dispatch), and the time a slice waited for its batch on the cluster: the
compute time of the host source's instances, which only hand on a batch read ahead by the
source's process (the first includes that process's start). Sizes are the example's ``LM_*`` variables (examples/lm/README.md).
Run: ``python bench/lm.py`` (``make bench``). The last stdout line is ``{"bench": "lm", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rallypoint.client.compile import ensure_host_devices  # noqa: E402

ensure_host_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from rallypoint.basics.errors import RallypointError  # noqa: E402
from rallypoint.basics.logs import configure  # noqa: E402
from rallypoint.client import Program  # noqa: E402
from rallypoint.client.compile import CompiledProgram, compile_program  # noqa: E402
from rallypoint.client.jobfile import load_program  # noqa: E402
from rallypoint.client.reference import ReferenceExecutor  # noqa: E402

TRAIN = ROOT / "examples" / "lm" / "train.py"


def lm_program(steps: int, variant: str) -> Program:
    """The LM job file's program for ``variant`` (sizes from the ``LM_*`` environment), without its eval node:
    the bench measures training steps against a plain loop of them."""
    os.environ["LM_VARIANT"] = variant
    os.environ["LM_EVAL_EVERY"] = "0"
    return load_program(TRAIN, steps=steps)


def steady(times: list[float], skip: int) -> float:
    """Steps/s from the end times of steps ``skip``..N-1."""
    if len(times) < skip + 2:
        return float("nan")
    return (len(times) - 1 - skip) / (times[-1] - times[skip])


def plain_loop(program: Program, steps: int, devices: list[Any] | None = None) -> dict[str, Any]:
    """The dp program's train step as a plain jitted loop: each step's end time, losses, source seconds."""
    if set(program.nodes) != {"batch", "train"}:
        raise ValueError("the plain loop runs the dp variant (a source and one train node)")
    n = program.slices["dp"].devices
    mesh = Mesh(np.array((devices or jax.devices())[:n]), ("data",))
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    source = program.nodes["batch"].fn
    params = jax.jit(program.states["params"].init, out_shardings=rep)()
    opt_state = jax.jit(program.states["opt_state"].init, out_shardings=rep)()
    train = jax.jit(program.nodes["train"].fn, donate_argnums=(0, 1))

    def batch(step: int) -> tuple[Any, Any, float]:
        t = time.perf_counter()
        b = source(step, 0)
        dt = time.perf_counter() - t
        return jax.device_put(b["inputs"], data), jax.device_put(b["targets"], data), dt

    times, losses, source_s = [], [], []
    x, y, dt = batch(0)
    source_s.append(dt)
    for s in range(steps):
        out = train(params, opt_state, x, y)
        params, opt_state = out["params"], out["opt_state"]
        if s + 1 < steps:  # read the next batch while the device computes this step
            x, y, dt = batch(s + 1)
            source_s.append(dt)
        losses.append(float(out["loss"]))  # the metric each step, as the cluster reports it
        times.append(time.perf_counter())
    return {"times": times, "losses": losses, "source_s": source_s, "tokens": float(out["tokens"])}


def run_reference(compiled: CompiledProgram) -> list[float]:
    times: list[float] = []
    ReferenceExecutor(compiled, on_step=lambda s, m: times.append(time.perf_counter())).run()
    return times


def run_cluster(compiled: CompiledProgram, variant: str, repeats: int, skip: int) -> dict[str, Any]:
    """The program on a fresh embedded cluster, ``repeats`` times; or why it could not run."""
    from rallypoint.client.submission import submit
    from rallypoint.cluster.local import LocalCluster, LocalClusterConfig

    devices = compiled.program.slices["dp"].devices if variant == "dp" else 2
    workers = 1 if variant == "dp" else 2
    state_dir = Path(tempfile.mkdtemp(prefix="rallypoint-bench-lm-"))
    lc = LocalCluster.start(LocalClusterConfig(state_dir=state_dir, workers=workers, spares=0,
                                               devices_per_worker=devices, coordinators=1))
    rates: list[float] = []
    waits: list[float] = []  # ms per step a slice waited for its host source's batch, after the first step
    sources = [n for n in compiled.order if compiled.nodes[n].host is not None]
    try:
        for r in range(repeats):
            times: list[float] = []
            try:
                result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, window=2, new_run=r > 0,
                                on_step=lambda s, m: times.append(time.perf_counter()))
            except RallypointError as exc:
                return {"ran": False, "why": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            rates.append(steady(times, skip))
            # A host source's instance only hands on a batch read ahead: its compute time is the slice's wait
            # (the first instances include the source process's start).
            compute = result.recovery.get("compute_s", {})
            waits.append(1000 * sum(compute.get(n, 0.0) for n in sources) / compiled.program.steps)
        exported = export_wall_s(lc.checkpoint_dir, compiled.program.name, repeats)
    finally:
        lc.stop()
    return {"ran": True, "steps_per_s": rates, "source_wait_ms": statistics.median(waits), **exported}


def export_wall_s(checkpoint_root: Path, job: str, repeats: int) -> dict[str, Any]:
    """``rallypoint export`` of the last run's newest committed cut (every state: read, checked against its
    commit, rebuilt as the job's tree, written as plain Orbax), ``repeats`` times: the median wall seconds."""
    from rallypoint.client.weights import export_run

    run = checkpoint_root / job / (checkpoint_root / job / "LATEST").read_text().strip()
    times = []
    with tempfile.TemporaryDirectory(prefix="rallypoint-bench-export-") as tmp:
        for i in range(repeats):
            t = time.perf_counter()
            manifest = export_run(run, Path(tmp) / f"out{i}")
            times.append(time.perf_counter() - t)
        size = sum(f.stat().st_size for f in (Path(tmp) / "out0").rglob("*") if f.is_file())
    return {"export_s": statistics.median(times), "export_step": manifest["step"], "export_bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=("dp", "pipeline"), default="dp")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=3, help="steps left out of the rate (compilation)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-cluster", action="store_true", help="only the in-process halves")
    args = ap.parse_args()
    configure(level="warning")

    program = lm_program(args.steps, args.variant)
    compiled = compile_program(program)
    tokens_per_step = float(program.nodes["batch"].fn(0, 0)["targets"].size) * (
        program.microbatches if args.variant == "pipeline" else 1)
    out: dict[str, Any] = {"bench": "lm", "variant": args.variant, "steps": args.steps,
                           "tokens_per_step": int(tokens_per_step),
                           "sizes": {k: v for k, v in sorted(os.environ.items()) if k.startswith("LM_")}}
    table: list[tuple[str, str]] = []

    plain = ref = None
    if args.variant == "dp":
        runs = [plain_loop(program, args.steps) for _ in range(args.repeats)]
        plain = statistics.median(steady(r["times"], args.skip) for r in runs) * tokens_per_step
        src_ms = statistics.median(1000 * statistics.median(r["source_s"]) for r in runs)
        out |= {"plain_tokens_per_s": round(plain, 1), "plain_source_ms_per_step": round(src_ms, 3),
                "plain_loss_first_last": [round(runs[0]["losses"][0], 4), round(runs[0]["losses"][-1], 4)]}
        table += [("plain jit loop", f"{plain:,.0f} tokens/s"),
                  ("  host source (Grain)", f"{src_ms:.2f} ms/step, read while the device computes")]
    ref = statistics.median(steady(run_reference(compiled), args.skip) for _ in range(args.repeats)) * tokens_per_step
    out["reference_tokens_per_s"] = round(ref, 1)
    vs_plain = f"  ({ref / plain:.2f} x plain)" if plain else ""
    table.append(("reference (in process)", f"{ref:,.0f} tokens/s{vs_plain}"))

    if args.no_cluster:
        out["cluster"] = "not run (--no-cluster)"
        table.append(("cluster", "not run (--no-cluster)"))
    else:
        cl = run_cluster(compiled, args.variant, args.repeats, args.skip)
        if not cl["ran"]:
            out["cluster"] = f"not run: {cl['why']}"
            table.append(("cluster", f"could not run: {cl['why']}"))
        else:
            rate = statistics.median(cl["steps_per_s"]) * tokens_per_step
            base = plain or ref
            against = "plain" if plain else "reference"
            out |= {"cluster_tokens_per_s": round(rate, 1), f"cluster_over_{against}": round(rate / base, 3),
                    "cluster_source_wait_ms_per_step": round(cl["source_wait_ms"], 3)}
            table.append(("cluster (embedded)", f"{rate:,.0f} tokens/s  ({rate / base:.2f} x {against})"))
            out |= {"export_s": round(cl["export_s"], 3), "export_step": cl["export_step"],
                    "export_bytes": cl["export_bytes"]}
            table.append(("  slice waiting for its batch", (f"{cl['source_wait_ms']:.2f} ms/step (all steps, the "
                                                            "source process's start included)")))
            table.append(("export (the LM's state)", f"{cl['export_s']:.3f} s, median of {args.repeats} (step "
                                                     f"{cl['export_step']}, {cl['export_bytes'] / 1e6:.1f} MB)"))
    for k, v in table:
        print(f"{k:>30}  {v}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
