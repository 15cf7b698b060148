"""Verification benchmark (docs/integrity.md): what verifying costs, and how soon it catches a corrupting worker.

One embedded cluster for the whole run: one worker for the job, two idle workers for the verifications. The
job is one slice (a stack of dense layers fitted by SGD, a few milliseconds a step), checkpoints every
``--every`` steps. Reported, side by side in one run:

* **cost**: the wall time to finish with verifications off, then every 4th, 2nd and every cut (``--verify-every``),
  then under a budget of 5% and 20% of the job's steps (``--verify-fraction``),
  the ratio off/on (the goodput the job keeps), and how long the job's end waited (``final_cut_s``: with
  verifications on, the verification of the final state). On this host the idle workers share the job's cores,
  so a verification's steps take CPU from the job; on hosts of their own they would cost the job nothing but
  the verification of its end.
* **detection**: the worker's ``corrupt`` fault flips a bit of the state at every step from ``--bad-from`` on;
  per setting, the step of the cut whose verification convicted it (the delay: that step minus ``--bad-from``),
  and that the run still ended bitwise equal to the reference.

The last stdout line is one JSON object ``{"bench": "verify", ...}``; the table goes to stderr. Run:
``python bench/verify.py`` (``make bench``); ``--repeats`` for medians of the cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax.numpy as jnp  # noqa: E402

from rallypoint.basics.logs import configure  # noqa: E402
from rallypoint.client import Program  # noqa: E402
from rallypoint.client.compile import compile_program  # noqa: E402
from rallypoint.client.reference import ReferenceExecutor  # noqa: E402
from rallypoint.client.submission import submit  # noqa: E402
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig  # noqa: E402
from rallypoint.proto import rallypoint_pb2 as pb  # noqa: E402
from rallypoint.workers.faults import WorkerFaults  # noqa: E402

SETTINGS = ((0, 0.0), (4, 0.0), (2, 0.0), (1, 0.0), (0, 0.05), (0, 0.2))  # (verify_every, verify_fraction): off first


def program(name: str, steps: int, every: int, width: int) -> Program:
    prog = Program(name, steps=steps, checkpoint_every=every)
    s = prog.slice("s", devices=1)
    w = prog.state("w", slice=s, init=lambda: jnp.eye(width, dtype=jnp.float32) * 0.5)
    data = prog.source("x", lambda step, mb: {"x": jnp.sin(jnp.arange(width * 32, dtype=jnp.float32)
                                                          .reshape(32, width) + step)}, slice=s, per="step",
                       outputs=("x",))

    def train(w: Any, x: Any) -> dict[str, Any]:
        h = x
        for _ in range(4):
            h = jnp.tanh(h @ w)
        loss = jnp.mean((h - x) ** 2)
        return {"w": w - 1e-3 * (h - x).T @ x / 32.0, "loss": loss}

    node = prog.node("train", train, slice=s, inputs={"w": w, "x": data["x"]}, outputs=("w", "loss"),
                     updates={"w": w})
    prog.metric("loss", node["loss"])
    return prog


def one(lc: LocalCluster, compiled: Any, k: tuple[int, float], arm: dict[str, Any] | None = None,
        flag: Path | None = None) -> tuple[float, Any, list[pb.JobEvent]]:
    """A run with ``(verify_every, verify_fraction)`` k; ``arm``: the corrupt spec written to ``flag`` for the worker the job is placed
    on (named once it starts), so only that worker corrupts."""
    events: list[pb.JobEvent] = []

    def on_event(ev: pb.JobEvent) -> None:
        events.append(ev)
        if arm is not None and flag is not None and ev.event == "job.started":
            worker = json.loads(ev.detail)["placement"]["s"]["worker"]
            flag.write_text(json.dumps({**arm, "worker": worker}))

    t0 = time.perf_counter()
    result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, on_event=on_event,
                    verify_every=k[0] or None, verify_fraction=k[1] or None, warm_spares=0, new_run=True)
    return time.perf_counter() - t0, result, events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--bad-from", type=int, default=95)
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    configure(level="warning")
    state = Path(tempfile.mkdtemp(prefix="rallypoint-bench-verify-"))
    flag = state / "corrupt.json"
    lc = LocalCluster.start(LocalClusterConfig(state_dir=state / "cluster", workers=1, spares=2, devices_per_worker=1,
                                               coordinators=1, worker_faults=WorkerFaults(corrupt_flag=str(flag))))
    out: dict[str, Any] = {"bench": "verify", "steps": a.steps, "every": a.every, "cost": {}, "detection": {}}
    try:
        compiled = compile_program(program("verify-bench", a.steps, a.every, a.width))
        want = ReferenceExecutor(compiled).run().state_digest
        one(lc, compiled, SETTINGS[0])  # compiles and warms the caches: not timed
        walls: dict[tuple[int, float], list[float]] = {k: [] for k in SETTINGS}
        ends: dict[tuple[int, float], list[float]] = {k: [] for k in SETTINGS}  # the end's wait: its verification
        for _ in range(a.repeats):
            for k in SETTINGS:  # alternated, so the host's load falls on every setting alike
                wall, result, _ = one(lc, compiled, k)
                assert result.state_digest == want, (k, "digest")
                walls[k].append(wall)
                ends[k].append(float(result.recovery.get("final_cut_s") or 0.0))
        base = statistics.median(walls[SETTINGS[0]])
        for k in SETTINGS:
            med = statistics.median(walls[k])
            out["cost"][name(k)] = {"wall_s": round(med, 3), "goodput_vs_off": round(base / med, 3),
                                   "final_cut_s": round(statistics.median(ends[k]), 3)}
        for k in SETTINGS[1:]:
            try:
                _, result, events = one(lc, compiled, k, {"slice": "s", "step": a.bad_from, "mode": "persist"}, flag)
            finally:
                flag.unlink(missing_ok=True)
            convicted = [json.loads(e.detail) for e in events if e.event == "job.sdc"
                         and json.loads(e.detail).get("verdict") == "convicted"]
            at = convicted[0]["to_step"] if convicted else None
            out["detection"][name(k)] = {"caught_at_cut": at, "delay_steps": at - a.bad_from if at is not None else None,
                                        "exact": result.state_digest == want}
            _uncordon(lc)
    finally:
        lc.stop()
    print(f"{'verifications':>13} {'wall s':>8} {'goodput vs off':>15} {'end wait s':>11} {'caught at cut':>14} "
          f"{'delay':>6} exact", file=sys.stderr)
    for k in SETTINGS:
        c, d = out["cost"][name(k)], out["detection"].get(name(k), {})
        print(f"{name(k):>13} {c['wall_s']:>8} {c['goodput_vs_off']:>15} {c['final_cut_s']:>11} "
              f"{str(d.get('caught_at_cut', '-')):>14} {str(d.get('delay_steps', '-')):>6} {d.get('exact', '-')}",
              file=sys.stderr)
    print(json.dumps(out))


def name(k: tuple[int, float]) -> str:
    """A setting as the table says it: off, every-K (every K-th cut) or fraction-F (a budget, every cut a candidate)."""
    return f"fraction-{k[1]:g}" if k[1] else f"every-{k[0]}" if k[0] else "off"


def _uncordon(lc: LocalCluster) -> None:
    """Take back the cordon a conviction left (the next run needs its workers)."""
    from rallypoint.orchestrator.api import uncordon

    store = lc.store()
    try:
        for w in ("w0", "w1", "w2"):
            uncordon(store, lc.keys, w)
    finally:
        store.close()


if __name__ == "__main__":
    main()
