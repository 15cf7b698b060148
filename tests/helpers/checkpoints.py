"""Slice checkpoints in tests (tests/workers/, tests/integration/): a commit callable that records, states
with awkward dtypes and the bitwise check of a restore, a checkpoint's largest file, and a worker's key
registered in etcd for the commits guarded on it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.store import Put, key_missing


class Recorder:
    """A commit callable that records commits; optionally blocks until released."""

    def __init__(self, fail_at: set[int] | None = None) -> None:
        self.commits: list[CheckpointCommit] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_at = fail_at or set()

    def __call__(self, c: CheckpointCommit) -> None:
        self.gate.wait(30)
        if c.step in self.fail_at:
            raise RuntimeError(f"commit of step {c.step} failed (test)")
        self.commits.append(c)

    @property
    def steps(self) -> list[int]:
        return [c.step for c in self.commits]


def states_at(seed: int, n: int = 1000) -> dict[str, list[np.ndarray]]:
    """States of a slice with incompressible values and awkward dtypes."""
    rng = np.random.default_rng(seed)
    nan = np.array([0x7FC0_1234 + seed], dtype=np.uint32).view(np.float32)  # a NaN with a payload
    return {
        "stage0.params": [rng.standard_normal((n // 10, 10)).astype(np.float32), np.concatenate([nan, nan])],
        "stage0.opt": [rng.standard_normal(n).astype(ml_dtypes.bfloat16), np.array(seed, dtype=np.int64),
                       np.array(seed % 2 == 0), rng.integers(0, 256, 17, dtype=np.uint8)],
    }


def assert_bitwise(got: dict[str, Any], want: dict[str, list[np.ndarray]]) -> None:
    assert sorted(got) == sorted(want)
    for name, leaves in want.items():
        assert len(got[name]) == len(leaves), name
        for g, w in zip(got[name], leaves, strict=True):
            g = np.asarray(g)
            assert (g.dtype, g.shape) == (w.dtype, w.shape), name
            assert g.tobytes() == w.tobytes(), name


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def register(store: EtcdStore, keys: Keys, worker: str) -> int:
    r = store.txn([key_missing(keys.worker(worker))], [Put(keys.worker(worker), "{}")])
    assert r.succeeded
    return r.revision
