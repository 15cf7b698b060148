"""What donating a state's buffers to the step that replaces them would buy: per-device memory and compile time.

The runtime keeps a state version until its last reader (and a checkpoint) is done with it, so a node's step
never donates its state arguments: the version it reads and the one it makes are both resident while it runs.
Donation would let XLA write the new version over the old one; it needs a second executable per node (the
runtime could donate only where it knows the version is dead, not where a checkpoint or a push still holds it).
This compiles the LM example's train step (examples/lm, ``LM_VARIANT``, sizes from ``LM_*``) as loaded on
4 CPU devices, with and without its state arguments donated, and prints XLA's memory analysis per device
(arguments, outputs, aliased, temporaries) and the compile time, median of ``--runs``.

    .venv/bin/python bench/donation.py [--variant dp|fsdp|tp] [--runs 3]

The last stdout line is one JSON object ``{"bench": "donation", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default="dp")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for key, value in (("LM_VARIANT", args.variant), ("LM_D_MODEL", "256"), ("LM_LAYERS", "4"), ("LM_BATCH", "16")):
        os.environ.setdefault(key, value)
    jax.config.update("jax_num_cpu_devices", 4)
    sys.path.insert(0, str(ROOT / "examples" / "lm"))
    import numpy as np
    import train  # the LM job file

    from rallypoint.client.compile import compile_program, slice_mesh

    prog = train.build(train.config())
    compiled = compile_program(prog)
    node = compiled.nodes["train"]
    slice_name = node.slice
    exp = jax.export.deserialize(bytearray(node.exported))
    mesh = slice_mesh(prog, slice_name)
    n_state = sum(compiled.states[s].tree.num_leaves for s in node.updates.values())
    shardings = exp.in_shardings_jax(mesh)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(exp.in_avals, shardings, strict=True)]
    state_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in exp.in_avals[:n_state])
    rows = {}
    for donate in (False, True):
        times, memory = [], None
        for _ in range(args.runs):
            jax.clear_caches()
            f = jax.jit(exp.call, in_shardings=shardings, out_shardings=exp.out_shardings_jax(mesh),
                        donate_argnums=tuple(range(n_state)) if donate else ())
            t0 = time.perf_counter()
            memory = f.lower(*avals).compile().memory_analysis()
            times.append(time.perf_counter() - t0)
        row = {"compile_s": round(statistics.median(times), 3)}
        if memory is not None:
            m = memory
            row.update(args_mib=m.argument_size_in_bytes / 2**20, out_mib=m.output_size_in_bytes / 2**20,
                       alias_mib=m.alias_size_in_bytes / 2**20, temp_mib=m.temp_size_in_bytes / 2**20,
                       peak_mib=(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                                 + m.temp_size_in_bytes) / 2**20)
        rows["donated" if donate else "kept"] = {k: round(v, 2) for k, v in row.items()}
        print(f"{'donated' if donate else 'kept   '}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()),
              file=sys.stderr)
    kept, donated = rows["kept"], rows["donated"]
    out = {"bench": "donation", "variant": args.variant, "state_mib_global": round(state_bytes / 2**20, 2),
           **rows, "compile_ratio": round(donated["compile_s"] / kept["compile_s"], 2)}
    if "peak_mib" in kept:
        out["peak_ratio"] = round(donated["peak_mib"] / kept["peak_mib"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
