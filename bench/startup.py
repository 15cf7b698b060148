"""Startup benchmark: what a process of the cluster pays before it does any work.

Every worker (and every fresh incarnation that replaces a lost one), host source and client that
runs a job imports JAX; a cluster start is mostly its workers importing JAX on the host's cores. This
times, in fresh processes, interleaved over ``--repeats`` rounds (medians; wall and CPU of the child):

* ``numpy``: ``import numpy``, the floor;
* ``ml_dtypes``: ``import numpy, ml_dtypes`` (JAX's dtypes; its extension's load is the cost pinned in
  pyproject.toml: 0.7.0 spent about 0.8 s of CPU there);
* ``jax``: ``import jax; jax.devices()`` (the CPU backend up);
* ``worker``: the worker daemon's imports;
* ``cluster``: an embedded cluster (mutual TLS, etcd auth) of one coordinator and ``--workers`` workers
  started and registered; ``cluster_stop``: its stop, until every process ended.

Usage (from the repo root; ``make bench`` runs it with the defaults)::

    python bench/startup.py [--repeats 3] [--workers 5] [--json-only]

The last stdout line is one JSON object starting with ``{"bench": "startup"``. Target: the dtypes'
load is at most 0.1 s of CPU over numpy's (``ml_dtypes_cpu_s``).
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

SNIPPETS = {
    "numpy": "import numpy",
    "ml_dtypes": "import numpy, ml_dtypes",
    "jax": "import jax; jax.devices()",
    "worker": "from rallypoint.workers.daemon import WorkerDaemon",
}
TARGET_ML_DTYPES_CPU_S = 0.1


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def time_snippet(code: str) -> tuple[float, float]:
    """(wall s, CPU s) of a fresh ``python -c code``."""
    cpu0, t0 = _child_cpu(), time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return time.perf_counter() - t0, _child_cpu() - cpu0


def time_cluster(workers: int) -> tuple[float, float]:
    """(start s, stop s) of an embedded cluster of one coordinator and ``workers`` workers."""
    from rallypoint.cluster.local import LocalCluster  # noqa: PLC0415
    from rallypoint.cluster.local_config import LocalClusterConfig  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="bench-startup-") as d:
        t0 = time.perf_counter()
        c = LocalCluster.start(LocalClusterConfig(state_dir=Path(d), workers=workers, spares=0, coordinators=1))
        t1 = time.perf_counter()
        c.stop()
        return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=5)
    ap.add_argument("--json-only", action="store_true")
    args = ap.parse_args()
    wall: dict[str, list[float]] = {k: [] for k in [*SNIPPETS, "cluster", "cluster_stop"]}
    cpu: dict[str, list[float]] = {k: [] for k in SNIPPETS}
    for _ in range(args.repeats):  # interleaved: the box's load falls on every kind alike
        for name, code in SNIPPETS.items():
            w, c = time_snippet(code)
            wall[name].append(w)
            cpu[name].append(c)
        up, down = time_cluster(args.workers)
        wall["cluster"].append(up)
        wall["cluster_stop"].append(down)
    med_wall = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    dtypes_cpu = med_cpu["ml_dtypes"] - med_cpu["numpy"]
    import ml_dtypes  # noqa: PLC0415

    result = {
        "bench": "startup", "repeats": args.repeats, "workers": args.workers, "ml_dtypes": ml_dtypes.__version__,
        "wall_s": {k: round(v, 3) for k, v in med_wall.items()},
        "cpu_s": {k: round(v, 3) for k, v in med_cpu.items()},
        "ml_dtypes_cpu_s": round(dtypes_cpu, 3), "ml_dtypes_share_of_jax_cpu": round(dtypes_cpu / med_cpu["jax"], 3),
        "target_ml_dtypes_cpu_s": TARGET_ML_DTYPES_CPU_S, "met": dtypes_cpu <= TARGET_ML_DTYPES_CPU_S,
    }
    if not args.json_only:
        print(f"startup, medians of {args.repeats} (ml_dtypes {ml_dtypes.__version__}):")
        for k in SNIPPETS:
            print(f"  {k:10s} wall {med_wall[k]:6.2f} s  cpu {med_cpu[k]:6.2f} s")
        print(f"  cluster    wall {med_wall['cluster']:6.2f} s  (1 coordinator, {args.workers} workers, TLS)")
        print(f"  its stop   wall {med_wall['cluster_stop']:6.2f} s  (every process ended)")
        print(f"  ml_dtypes' load: {dtypes_cpu:.2f} s of CPU ({dtypes_cpu / med_cpu['jax']:.0%} of a JAX start); "
              f"target <= {TARGET_ML_DTYPES_CPU_S} s: {'met' if result['met'] else 'MISSED'}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
