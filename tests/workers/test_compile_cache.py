"""The persistent compilation cache: a reloaded slice loads its programs instead of compiling.

Two worker-side loads of the same exported program, each in a fresh process (as a
restarted worker or a spare is), share a cache directory: the first compiles and
writes the executable there, the second finds it (JAX's ``cache_hits`` event) and
runs it to bitwise the same result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from rallypoint.cluster.local import LocalCluster, LocalClusterConfig
from rallypoint.workers.programs import configure_compile_cache

# One worker-side load in a fresh process: configure the cache as the daemon does at
# start-up, load the exported bytes onto a one-device slice, run it once.
LOAD_AND_RUN = """
import json, sys
import jax, numpy as np
from rallypoint.workers.programs import configure_compile_cache, load_exported, slice_mesh

configure_compile_cache(sys.argv[2])
events = []
jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
call = load_exported(open(sys.argv[1], "rb").read(), slice_mesh(jax.local_devices()[:1], (1,), ("x",)))
(out,) = call(np.arange(64, dtype=np.float32).reshape(8, 8) / 64, np.ones((4, 8), np.float32))
print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses"),
                  "out": np.asarray(out).tobytes().hex()}))
"""


def export_small_program(path: Path) -> None:
    def node(w: jax.Array, x: jax.Array) -> tuple[jax.Array]:
        return (jnp.tanh(x @ w).sum(axis=0),)

    exp = jax.export.export(jax.jit(node))(jax.ShapeDtypeStruct((8, 8), jnp.float32),
                                           jax.ShapeDtypeStruct((4, 8), jnp.float32))
    path.write_bytes(exp.serialize())


def load_in_fresh_process(blob: Path, cache: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "XLA_FLAGS"))}
    r = subprocess.run([sys.executable, "-c", LOAD_AND_RUN, str(blob), str(cache)], capture_output=True, text=True,
                       env=env | {"JAX_PLATFORMS": "cpu"}, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def cache_entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("*-cache"))


@pytest.mark.processes
def test_a_second_process_loads_the_program_from_the_shared_cache(tmp_path: Path) -> None:
    blob, cache = tmp_path / "node.jax", tmp_path / "compile-cache"
    export_small_program(blob)

    first = load_in_fresh_process(blob, cache)
    assert (first["hits"], first["misses"]) == (0, 1), first
    entries = cache_entries(cache)
    assert entries, "the first load should have written its executable, however small and quick to compile"

    second = load_in_fresh_process(blob, cache)
    assert (second["hits"], second["misses"]) == (1, 0), second
    assert second["out"] == first["out"]  # the cached executable computes bitwise the same
    assert cache_entries(cache) == entries


def test_an_empty_directory_setting_leaves_the_cache_off() -> None:
    assert configure_compile_cache("") is None


def test_the_local_cluster_gives_every_worker_one_shared_cache(tmp_path: Path) -> None:
    def worker_argv(**cfg: Any) -> list[str]:
        lc = LocalCluster(LocalClusterConfig(state_dir=tmp_path / "c", **cfg), ["127.0.0.1:1"], [])
        return lc.argv("worker", "w0")

    def option(argv: list[str], name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else None

    assert option(worker_argv(), "--compile-cache-dir") == str((tmp_path / "c" / "compile-cache").absolute())
    assert option(worker_argv(compile_cache_dir=tmp_path / "shared"), "--compile-cache-dir") == str(tmp_path / "shared")
    assert option(worker_argv(compile_cache_dir=""), "--compile-cache-dir") is None
    lc = LocalCluster(LocalClusterConfig(state_dir=tmp_path / "c"), ["127.0.0.1:1"], [])
    assert "--compile-cache-dir" not in lc.argv("coordinator", "c0")

