"""Device benchmark: the cluster against a plain in-process ``jax.jit`` loop of the same work.

Reports, side by side in one run (medians of ``--repeats``):

1. **single slice**: a job of one slice whose step is heavy enough that a host round
   trip of its state would show (a ``--width`` x ``--width`` float32 weight, about
   50-100 ms of compute per step on this machine's CPU), on an embedded cluster of one
   worker, against a plain loop of the same Python functions under ``jax.jit`` with the
   state donated (no Rallypoint). Target: cluster steps/s >= 0.97 x the plain loop.
   Also the per-instance overhead in microseconds (the cluster's step time minus the
   loop's, per instance), and the bytes the worker copied between host and device by
   purpose (``rallypoint_worker_copy_bytes``: only checkpoints, metrics, the step
   numbers and the final fetch; no ``transfer``).
2. **pipeline**: the 4-stage pipeline example with heavy stages on 4 workers of one
   device, against the in-process reference executor (the same exported programs run
   one after another in this process), as ``bench/dispatch.py`` measures it.

Steady-state rates skip the first two steps (compilation). Run: ``python bench/device.py``
(``make bench``); ``--strict`` exits 1 when the single-slice target is missed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rallypoint.client.compile import ensure_host_devices  # noqa: E402

ensure_host_devices(8)  # as bench/dispatch.py (imported below) asks

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.dispatch import pipeline_module, run_both  # noqa: E402
from rallypoint.basics.logs import configure  # noqa: E402
from rallypoint.client import Program  # noqa: E402
from rallypoint.client.compile import compile_program  # noqa: E402
from rallypoint.client.submission import submit  # noqa: E402
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig  # noqa: E402

LR = 1e-3


def make_init(width: int):  # type: ignore[no-untyped-def]
    def init() -> Any:
        return {"w": jnp.eye(width, dtype=jnp.float32) * 0.5, "v": jnp.zeros((width, width), jnp.float32)}
    return init


def make_batch(width: int, rows: int):  # type: ignore[no-untyped-def]
    def batch(step: Any, microbatch: Any) -> Any:
        return jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(3), step), (rows, width), jnp.float32)
    return batch


def train(state: Any, x: Any) -> Any:
    """An autoencoder step with momentum: two matmuls forward, their gradients back."""
    def loss_fn(w: Any) -> Any:
        return jnp.mean((jnp.tanh(x @ w) @ w.T - x) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(state["w"])
    v = 0.9 * state["v"] + g
    return {"w": state["w"] - LR * v, "v": v}, loss


def single_slice_program(steps: int, width: int, rows: int) -> Program:
    prog = Program("device-bench", steps=steps, checkpoint_every=steps // 2)
    s = prog.slice("s", devices=1)
    state = prog.state("state", slice=s, init=make_init(width))
    batch = prog.source("batch", make_batch(width, rows), slice=s, per="step", outputs=("x",))
    node = prog.node("train", train, slice=s, inputs={"state": state, "x": batch["x"]},
                     outputs=("state", "loss"), updates={"state": state})
    prog.metric("loss", node["loss"])
    return prog


def plain_loop(steps: int, width: int, rows: int) -> list[float]:
    """The same functions under ``jax.jit``, state donated, in this process: each step's end time."""
    device = jax.devices()[0]
    batch = jax.jit(make_batch(width, rows), device=device)
    step_fn = jax.jit(train, donate_argnums=0, device=device)
    state = jax.jit(make_init(width), device=device)()
    times = []
    for s in range(steps):
        state, loss = step_fn(state, batch(jnp.int32(s), jnp.int32(0)))
        float(loss)  # the metric each step, as the cluster reports it
        times.append(time.perf_counter())
    return times


def steady(times: list[float], skip: int = 2) -> float:
    return (len(times) - 1 - skip) / (times[-1] - times[skip]) if len(times) > skip + 2 else float("nan")


def worker_copies(lc: LocalCluster) -> dict[str, float]:
    """``rallypoint_worker_copy_bytes`` of every worker of ``lc``, summed by direction/purpose."""
    out: dict[str, float] = {}
    for target in lc.metrics_targets():
        if target["role"] != "worker":
            continue
        text = urllib.request.urlopen(f"http://{target['address']}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith("rallypoint_worker_copy_bytes_total{"):
                labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(","))
                key = f"{labels['direction'].strip(chr(34))}/{labels['purpose'].strip(chr(34))}"
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--width", type=int, default=2048, help="single slice: the weight is width x width float32")
    ap.add_argument("--rows", type=int, default=256, help="single slice: rows per batch")
    ap.add_argument("--pipeline-steps", type=int, default=10)
    ap.add_argument("--pipeline-width", type=int, default=1024)
    ap.add_argument("--pipeline-microbatch-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strict", action="store_true", help="exit 1 when the single-slice target is missed")
    args = ap.parse_args()
    configure(level="warning")

    single = compile_program(single_slice_program(args.steps, args.width, args.rows))
    state_mb = 2 * args.width * args.width * 4 / 2**20
    plain, cluster, copies = [], [], {}
    state_dir = Path(tempfile.mkdtemp(prefix="rallypoint-bench-"))
    lc = LocalCluster.start(LocalClusterConfig(state_dir=state_dir / "one", workers=1, spares=0,
                                               devices_per_worker=1, coordinators=1))
    try:
        for r in range(args.repeats):  # interleaved: the machine's load hits both alike
            plain.append(steady(plain_loop(args.steps, args.width, args.rows)))
            times: list[float] = []
            submit(single, endpoints=lc.endpoints, cluster=lc.keys.cluster, window=2, new_run=r > 0,
                   on_step=lambda s, m: times.append(time.perf_counter()))
            cluster.append(steady(times))
        copies = worker_copies(lc)
    finally:
        lc.stop()
    p, c = statistics.median(plain), statistics.median(cluster)
    instances = 2  # the source and the train step
    overhead_us = (1 / c - 1 / p) / instances * 1e6
    out: dict[str, Any] = {
        "bench": "device", "steps": args.steps, "width": args.width, "rows": args.rows,
        "state_mib": round(state_mb, 1), "plain_steps_per_s": round(p, 3), "cluster_steps_per_s": round(c, 3),
        "cluster_over_plain": round(c / p, 3), "step_ms": round(1000 / p, 1),
        "overhead_us_per_instance": round(overhead_us, 1), "target": "cluster >= 0.97 x plain loop",
        "target_met": c >= 0.97 * p, "copy_bytes": {k: int(v) for k, v in sorted(copies.items())},
        "plain_runs": [round(x, 3) for x in plain], "cluster_runs": [round(x, 3) for x in cluster]}

    mod = pipeline_module()
    heavy = compile_program(mod.build(args.pipeline_steps, width=args.pipeline_width,
                                      microbatch_size=args.pipeline_microbatch_size))
    lc = LocalCluster.start(LocalClusterConfig(state_dir=state_dir / "four", workers=4, spares=0,
                                               devices_per_worker=1, coordinators=1))
    try:
        runs = [run_both(lc, heavy, 2, new_run=r > 0) for r in range(args.repeats)]
    finally:
        lc.stop()
    ref = statistics.median(r["reference_steps_per_s"] for r in runs)
    cl = statistics.median(r["cluster_steps_per_s"] for r in runs)
    out |= {"pipeline_reference_steps_per_s": round(ref, 3), "pipeline_cluster_steps_per_s": round(cl, 3),
            "pipeline_cluster_over_reference": round(cl / ref, 3)}
    table = [
        ("single slice state", f"{state_mb:.0f} MiB, step {1000 / p:.0f} ms"),
        ("plain jit loop (donated)", f"{p:.2f} steps/s"),
        ("cluster, one worker", f"{c:.2f} steps/s  ({c / p:.3f} x plain)"),
        ("overhead", f"{overhead_us:.0f} us / instance"),
        ("worker copies", ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(copies.items())) or "-"),
        ("pipeline reference", f"{ref:.2f} steps/s"),
        ("pipeline cluster", f"{cl:.2f} steps/s  ({cl / ref:.2f} x reference)"),
    ]
    for k, v in table:
        print(f"{k:>26}  {v}", file=sys.stderr)
    print(json.dumps(out))
    if args.strict and not out["target_met"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
