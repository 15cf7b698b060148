"""Instance records: one line per instance a runtime ran, written where the job's checkpoints live.

Evidence for the chaos harness's "every step applied exactly once per node"
(chaos/invariants.py) that outlives any process: the worker that ran an instance
writes its record, so a lost coordinator or worker loses none that were written.
Each loaded runtime writes ``<run>/instances/<worker>-<incarnation>-<token>.jsonl``:
a first line describing the runtime (worker, incarnation, slices, the step it
started from and the checkpoint step it restored), then one line per instance
``{"n": node, "s": step, "m": microbatch, "t": unix time, "c": compute seconds}``.
Lines are written unbuffered (a SIGKILL loses none already written). A line the
filesystem refuses (full, read-only) is kept in memory and written before the next
one once it can be; a record never fails the job. A run without a checkpoint
directory keeps no records.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rallypoint.workers import meter


class InstanceRecords:
    """The record file of one runtime (or nothing when ``run_dir`` is None)."""

    def __init__(self, run_dir: Path | None, *, worker: str, incarnation: int, slices: Sequence[str], start_step: int,
                 restored_from: int | None, job: str = "") -> None:
        self.job = job
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._path: Path | None = None
        self._pending = b""  # bytes the filesystem has not taken yet
        if run_dir is None:
            return
        self._path = run_dir / "instances" / f"{worker}-{incarnation}-{uuid.uuid4().hex[:8]}.jsonl"
        self._write({"runtime": self._path.stem, "worker": worker, "incarnation": incarnation, "slices": list(slices),
                     "start_step": start_step, "restored_from": restored_from, "loaded_at": time.time()})

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            if self._path is None:
                return
            self._pending += (json.dumps(record, separators=(",", ":")) + "\n").encode()
            self._flush()

    def _flush(self) -> None:
        assert self._path is not None
        try:
            if self._fd is None:  # opened on first use, again after the filesystem refused it
                self._path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            while self._pending:
                n = os.write(self._fd, self._pending)
                self._pending = self._pending[n:]
        except OSError:
            pass  # kept: written with the next record once the filesystem takes it

    def ran(self, node: str, step: int, microbatch: int, compute_s: float) -> None:
        meter.instance(self.job, compute_s)  # docs/metrics.md
        self._write({"n": node, "s": step, "m": microbatch, "t": round(time.time(), 4), "c": round(compute_s, 6)})

    def close(self) -> None:
        with self._lock:
            if self._path is not None:
                self._flush()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._path = None


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every runtime's records under ``run_dir``: ``{**header, "instances": [...]}``, in load order."""
    runtimes = []
    for path in sorted((run_dir / "instances").glob("*.jsonl")):
        lines = path.read_text().splitlines()
        if not lines:
            continue
        try:
            header = json.loads(lines[0])
        except ValueError:
            continue
        instances = []
        for line in lines[1:]:
            try:
                instances.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a kill: the instance did not count as recorded
        runtimes.append({**header, "instances": instances})
    return sorted(runtimes, key=lambda r: r["loaded_at"])
