"""Final-cut benchmark: what committing a job's final state costs, against one step, in one run.

Every job commits its final state at ``steps`` (docs/checkpoints.md, "The final cut"). This
runs the LM example (``examples/lm``, its ``LM_*`` sizes; ``dp``: one worker of
``LM_DEVICES`` devices) ``--runs`` times on one embedded cluster, with checkpoints only at
the end (``checkpoint_every`` larger than ``--steps``), and reports, medians over the runs:

* **step**: the steady step time (the client's ``step.done`` intervals after the first
  ``--skip`` steps, which compile);
* **final cut**: the executor's wait from the last step done to the final cut committed
  (``final_cut_s`` of ``job.finished``: the device-to-host copy, Orbax's write and finalize,
  the etcd commit and its report), and the ratio final cut / step;
* the state's bytes;
* where the final cut's time goes, from the worker's log: Orbax's save to finalized
  (``checkpoint.saved``'s ``save_s``: the host copy, the write, the finalize), then the
  checksum and the etcd commit (``checkpoint.committed``'s ``commit_s`` less ``save_s``);
  the rest of the wait is the commit's report to the executor and the slice noticing the
  last step was done.

The table goes to stderr; the last stdout line is ``{"bench": "final_cut", ...}``.
Run: ``python bench/final_cut.py`` (``make bench``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rallypoint.client.compile import ensure_host_devices  # noqa: E402

ensure_host_devices(8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3)
    args = ap.parse_args()

    import jax

    from rallypoint.client.compile import compile_program
    from rallypoint.client.jobfile import load_program
    from rallypoint.client.submission import submit
    from rallypoint.cluster.local import LocalCluster, LocalClusterConfig

    program = load_program(ROOT / "examples" / "lm" / "train.py", steps=args.steps)
    program.checkpoint_every = args.steps + 1  # the final cut is the only checkpoint
    compiled = compile_program(program, platforms=("cpu",))
    devices = max(s.devices for s in program.slices.values())
    state_bytes = sum(int(a.size) * a.dtype.itemsize for st in compiled.states.values()
                      for a in jax.tree_util.tree_leaves(st.aval))
    state_dir = Path(tempfile.mkdtemp(prefix="rallypoint-bench-final-cut-"))
    lc = LocalCluster.start(LocalClusterConfig(state_dir=state_dir, workers=len(program.slices), spares=0,
                                               devices_per_worker=devices, coordinators=1))
    step_s: list[float] = []
    cut_s: list[float] = []
    try:
        for r in range(args.runs):
            times: list[float] = []
            result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, window=2, new_run=r > 0,
                            on_step=lambda s, m: times.append(time.perf_counter()))
            gaps = [b - a for a, b in zip(times[args.skip:], times[args.skip + 1:])]
            step_s.append(statistics.median(gaps))
            cut_s.append(float(result.recovery["final_cut_s"]))
        saved, committed = phases(state_dir / "logs", args.steps)
    finally:
        lc.stop()
    step, cut = statistics.median(step_s), statistics.median(cut_s)
    print(f"final cut of the LM state ({state_bytes / 2**20:.1f} MiB, {devices} devices), medians of {args.runs} runs:\n"
          f"  step       {1000 * step:8.1f} ms\n  final cut  {1000 * cut:8.1f} ms   ({cut / step:.2f} steps)\n"
          f"    of which Orbax save to finalized {1000 * saved:.1f} ms, checksum and etcd commit "
          f"{1000 * (committed - saved):.1f} ms", file=sys.stderr)
    print(json.dumps({"bench": "final_cut", "state_bytes": state_bytes, "step_s": step_s, "final_cut_s": cut_s,
                      "final_cut_over_step": round(cut / step, 3),
                      "orbax_save_s": round(saved, 4), "commit_s": round(committed - saved, 4)}))


def phases(logs: Path, steps: int) -> tuple[float, float]:
    """Medians over the final cuts in the workers' logs: Orbax's ``save_s`` and the ``commit_s`` (save included)."""
    saved: list[float] = []
    committed: list[float] = []
    for f in logs.glob("w*.log"):
        for line in f.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("step") == steps and e.get("event") == "checkpoint.saved":
                saved.append(float(e["save_s"]))
            elif e.get("step") == steps and e.get("event") == "checkpoint.committed":
                committed.append(float(e["commit_s"]))
    return (statistics.median(saved) if saved else float("nan"),
            statistics.median(committed) if committed else float("nan"))


if __name__ == "__main__":
    main()
