"""Commit verification benchmark: what reading each checkpoint back from disk before its commit costs.

A slice's checkpoint is verified against the bytes on disk before it is committed
(``workers/checkpoints/checkpointer.py``: its files flushed, dropped from the page cache,
read back with Orbax alone and checked against the commit's checksum), so that retention
never deletes the step a corrupted write would have superseded. This saves the LM example's
state (``examples/lm``: its weights and Adam's state, host arrays; ``--layers`` and
``--d-model`` as ``LM_LAYERS`` and ``LM_D_MODEL``, defaults the example's, and a larger
size) through a real :class:`~rallypoint.workers.checkpoints.checkpointer.SliceCheckpointer`
into a temporary directory, ``--repeats`` steps each with verification off and on, and
reports medians:

* **save**: ``save()`` to the commit made, verification off (Orbax's host copy, write,
  finalize, the checksum of memory);
* **verify**: the read-back alone (``checkpoint.verified``'s ``verify_s``);
* **save + verify**: ``save()`` to the commit made, verification on, and its ratio to save.

The verification runs on the commit thread: a step's device loop does not wait for it; what
grows is the time until the checkpoint counts. The table goes to stderr; the last stdout
line is ``{"bench": "commit_verify", ...}``. Run: ``python bench/commit_verify.py``.
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "lm"))

import jax  # noqa: E402

import model as lm  # noqa: E402  (examples/lm/model.py)
from rallypoint.etcd.commits import CheckpointCommit  # noqa: E402
from rallypoint.workers.checkpoints.checkpointer import SliceCheckpointer  # noqa: E402


class _Timed(SliceCheckpointer):
    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.verify_s: list[float] = []

    def _verify(self, c: CheckpointCommit, path: Path) -> None:
        t0 = time.perf_counter()
        super()._verify(c, path)
        if self.verify_on_disk:
            self.verify_s.append(time.perf_counter() - t0)


def lm_state(layers: int, d_model: int, heads: int, context: int) -> dict[str, list[np.ndarray]]:
    """The LM example's slice state: its weights and Adam's state, as host arrays."""
    params = lm.init(lm.ModelConfig(layers, d_model, heads, context, 0), 0, layers)
    opt_state = lm.optimizer(3e-3).init(params)
    return {"params": [np.asarray(x) for x in jax.tree_util.tree_leaves(params)],
            "opt_state": [np.asarray(x) for x in jax.tree_util.tree_leaves(opt_state)]}


def run(states: dict[str, list[np.ndarray]], repeats: int, verify: bool, root: Path) -> tuple[list[float], list[float]]:
    ck = _Timed(root / ("on" if verify else "off"), job="bench", slice_name="s0", max_to_keep=2,
                commit=lambda c: None, verify_on_disk=verify)
    walls = []
    try:
        for step in range(repeats + 1):  # the first warms Orbax up
            t0 = time.perf_counter()
            ck.save(step, states)
            ck.wait()
            if step:
                walls.append(time.perf_counter() - t0)
        return walls, ck.verify_s[1:]
    finally:
        ck.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2x64,8x512", help="LAYERSxD_MODEL,... (the example's default first)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rp-commit-verify-") as tmp:
        for size in args.sizes.split(","):
            layers, d_model = (int(x) for x in size.split("x"))
            states = lm_state(layers, d_model, heads=4, context=64)
            nbytes = sum(x.nbytes for leaves in states.values() for x in leaves)
            off, _ = run(states, args.repeats, False, Path(tmp) / size)
            on, verify = run(states, args.repeats, True, Path(tmp) / size)
            save, total, v = statistics.median(off), statistics.median(on), statistics.median(verify)
            rows.append({"layers": layers, "d_model": d_model, "bytes": nbytes, "save_s": round(save, 4),
                         "verify_s": round(v, 4), "save_and_verify_s": round(total, 4),
                         "ratio": round(total / save, 3), "verify_over_save": round(v / save, 3)})
    print(f"{'size':>8} {'MB':>8} {'save s':>8} {'verify s':>9} {'save+verify s':>14} {'ratio':>6}", file=sys.stderr)
    for r in rows:
        print(f"{r['layers']}x{r['d_model']:<6} {r['bytes'] / 1e6:8.2f} {r['save_s']:8.4f} {r['verify_s']:9.4f} "
              f"{r['save_and_verify_s']:14.4f} {r['ratio']:6.2f}", file=sys.stderr)
    print(json.dumps({"bench": "commit_verify", "rows": rows}))


if __name__ == "__main__":
    main()
