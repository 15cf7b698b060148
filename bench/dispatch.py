"""Dispatch benchmark: the pipeline example on the local cluster against the reference, in one run.

Reports, side by side:

1. steps/s of the 4-stage pipeline with heavy stages (>= 20 ms of compute per
   instance) on the embedded cluster and in the in-process reference, and their
   ratio (target: the cluster within 10% of the reference, or faster: stages run in
   parallel on the cluster);
2. the per-instance dispatch overhead, from a pipeline with tiny stages (cluster
   wall time per instance minus the reference's);
3. worker-to-worker tensor transfer throughput against a raw loopback TCP socket
   moving the same bytes between two processes (target: at least half): the workers'
   data plane (plain TCP, each array received in place), and the gRPC ``Push``
   fallback (chunked stream) for comparison.

Steady-state rates skip the first step (compilation). The machine is shared and
noisy: medians of ``--repeats`` runs. Run: ``python bench/dispatch.py`` (``make bench``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rallypoint.client.compile import ensure_host_devices  # noqa: E402

ensure_host_devices(8)

import importlib.util  # noqa: E402

from rallypoint.client.compile import CompiledProgram, compile_program  # noqa: E402
from rallypoint.client.reference import ReferenceExecutor  # noqa: E402
from rallypoint.client.submission import submit  # noqa: E402
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig  # noqa: E402
from rallypoint.basics.logs import configure  # noqa: E402


def pipeline_args(ap: Any, *, steps: int = 60, every: int = 10) -> None:
    """The options every recovery-style benchmark takes: the heavier pipeline, its checkpoints, repeats."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--every", type=int, default=every, help="checkpoint every K steps")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--microbatch-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")


def pipeline_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("pipeline_mlp", ROOT / "examples" / "pipeline_mlp.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def steady_rate(times: list[float]) -> float:
    """Steps/s from the completion times of steps 1..N (step 0 compiles)."""
    if len(times) < 3:
        return float("nan")
    return (len(times) - 1) / (times[-1] - times[0])


def timed(run: Callable[[Callable[[int, dict[str, float]], None]], object]) -> tuple[list[float], object]:
    times: list[float] = []
    result = run(lambda step, metrics: times.append(time.perf_counter()))
    return times, result


def instance_ms(compiled: CompiledProgram) -> float:
    """Median compute time of one forward instance of stage 1 in this process."""
    import numpy as np

    from rallypoint.workers.programs import load_exported, slice_mesh
    import jax

    node = compiled.nodes["fwd1"]
    call = load_exported(node.exported, slice_mesh(jax.devices()[:1], (1,), ("d",)))
    aval_x = compiled.nodes["fwd0"].out_avals["out"]
    params = compiled.states["params1"].aval
    args = [np.zeros(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(params)]
    args += [np.zeros(aval_x.shape, aval_x.dtype)]
    jax.block_until_ready(call(*args))
    samples = []
    for _ in range(7):
        t = time.perf_counter()
        jax.block_until_ready(call(*args))
        samples.append((time.perf_counter() - t) * 1000)
    return statistics.median(samples)


def run_both(lc: LocalCluster, compiled: CompiledProgram, window: int, *, new_run: bool = False) -> dict[str, float]:
    """The reference and the cluster on ``compiled``, one after the other (``new_run``: the job ran here before)."""
    ref_times, _ = timed(lambda cb: ReferenceExecutor(compiled, on_step=cb).run())
    cl_times, _ = timed(lambda cb: submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, window=window,
                                           on_step=cb, new_run=new_run))
    return {"reference_steps_per_s": steady_rate(ref_times), "cluster_steps_per_s": steady_rate(cl_times),
            "reference_wall_s": ref_times[-1] - ref_times[0], "cluster_wall_s": cl_times[-1] - cl_times[0]}


# -- transfer throughput ------------------------------------------------------------------


def _raw_receiver(port_q: mp.Queue, total: int) -> None:  # type: ignore[type-arg]
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    got = 0
    buf = bytearray(1 << 20)
    while got < total:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    conn.sendall(b"k")
    conn.close()


def raw_socket_mb_s(value_mb: int, count: int) -> float:
    """The same bytes over a bare loopback TCP socket between two processes (receiver reuses one buffer)."""
    total = (value_mb << 20) * count
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    p = ctx.Process(target=_raw_receiver, args=(q, total))
    p.start()
    port = q.get(timeout=30)
    data = memoryview(bytearray(value_mb << 20))
    s = socket.create_connection(("127.0.0.1", port))
    t = time.perf_counter()
    for _ in range(count):
        s.sendall(data)
    s.recv(1)
    dt = time.perf_counter() - t
    s.close()
    p.join(timeout=10)
    return value_mb * count / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024, help="heavy pipeline: stage width")
    ap.add_argument("--microbatch-size", type=int, default=1024, help="heavy pipeline: rows per microbatch")
    ap.add_argument("--window", type=int, default=0, help="steps in flight (0: the leader decides)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--value-mb", type=int, default=4, help="transfer: size of one value")
    ap.add_argument("--values", type=int, default=64, help="transfer: values per measurement")
    args = ap.parse_args()
    configure(level="warning")
    mod = pipeline_module()
    heavy = compile_program(mod.build(args.steps, width=args.width, microbatch_size=args.microbatch_size))
    tiny = compile_program(mod.build(args.steps, width=8, microbatch_size=4))
    per_instance_ms = instance_ms(heavy)

    out: dict[str, object] = {"bench": "dispatch", "steps": args.steps, "width": args.width,
                              "microbatch_size": args.microbatch_size, "instance_ms": round(per_instance_ms, 2)}
    state = Path(tempfile.mkdtemp(prefix="rallypoint-bench-"))
    lc = LocalCluster.start(LocalClusterConfig(state_dir=state, workers=4, spares=0, devices_per_worker=1,
                                               coordinators=1))
    try:
        # one job name for all runs: every run after the first is a new run of it (the earlier ones' commits kept)
        heavy_runs = [run_both(lc, heavy, args.window, new_run=r > 0) for r in range(args.repeats)]
        tiny_runs = [run_both(lc, tiny, args.window, new_run=True) for _ in range(args.repeats)]
    finally:
        lc.stop()
    ref = statistics.median(r["reference_steps_per_s"] for r in heavy_runs)
    cl = statistics.median(r["cluster_steps_per_s"] for r in heavy_runs)
    instances = sum(tiny.program.microbatches if n.per == "microbatch" else 1 for n in tiny.nodes.values())
    overhead_ms = statistics.median(
        (r["cluster_wall_s"] - r["reference_wall_s"]) / ((args.steps - 1) * instances) * 1000 for r in tiny_runs
    )
    out |= {"reference_steps_per_s": round(ref, 3), "cluster_steps_per_s": round(cl, 3),
            "cluster_over_reference": round(cl / ref, 3), "target_steps": "cluster >= 0.9 x reference",
            "steps_target_met": cl >= 0.9 * ref, "tiny_instances_per_step": instances,
            "dispatch_overhead_ms_per_instance": round(overhead_ms, 3)}
    from bench._push_peer import measure_dataplane, measure_grpc_push

    raw = statistics.median(raw_socket_mb_s(args.value_mb, args.values) for _ in range(args.repeats))
    data = statistics.median(measure_dataplane(args.value_mb, args.values) for _ in range(args.repeats))
    grpc_push = statistics.median(measure_grpc_push(args.value_mb, args.values) for _ in range(args.repeats))
    out |= {"value_mb": args.value_mb, "raw_socket_mb_s": round(raw, 1), "dataplane_mb_s": round(data, 1),
            "dataplane_over_raw": round(data / raw, 3), "grpc_push_mb_s": round(grpc_push, 1),
            "grpc_push_over_raw": round(grpc_push / raw, 3), "target_transfer": "data plane >= 0.5 x raw socket",
            "transfer_target_met": data >= 0.5 * raw}
    table = [
        ("instance compute (heavy)", f"{per_instance_ms:.1f} ms"),
        ("reference", f"{ref:.2f} steps/s"),
        ("cluster", f"{cl:.2f} steps/s  ({cl / ref:.2f} x reference)"),
        ("dispatch overhead", f"{overhead_ms:.2f} ms / instance"),
        ("raw loopback socket", f"{raw:.0f} MB/s"),
        ("worker data plane", f"{data:.0f} MB/s  ({data / raw:.2f} x raw)"),
        ("gRPC Push (fallback)", f"{grpc_push:.0f} MB/s  ({grpc_push / raw:.2f} x raw)"),
    ]
    for k, v in table:
        print(f"{k:>26}  {v}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
