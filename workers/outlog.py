"""The output log: every value a worker sent to another worker, kept until no recovery needs it.

Upstream backup (DESIGN.md, "Flow of one step", 6). A producer logs each value it
pushes to a consumer on another worker, keyed like delivery (consumer node, input,
step, microbatch). When that consumer's worker is lost, its slices restore their
checkpoint at the consistent cut ``c`` and re-run from ``c``: the producer sends its
logged values of steps ``>= c`` again (:meth:`OutputLog.entries`), and nothing
upstream re-runs. Values of steps below the newest consistent cut can never be
asked for again and are dropped (:meth:`OutputLog.trim`).

Memory is bounded: past ``limit_bytes`` the oldest values spill to files in
``spill_dir`` (``numpy.save`` of each leaf, read back on resend). Nothing is ever
dropped that a recovery could need; the counters say where the bytes are.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.runtime_state import Key, Leaves


@dataclass
class _Entry:
    header: pb.TransferHeader
    leaves: Leaves | None  # None: spilled to ``path``
    nbytes: int
    path: Path | None = None


class OutputLog:
    """Logged outputs of one job on one worker; thread-safe.

    Args:
        limit_bytes: bytes held in memory before the oldest entries spill to disk.
        spill_dir: where spilled entries go (a private temporary directory if None);
            removed by :meth:`close`.
    """

    def __init__(self, limit_bytes: int, *, spill_dir: Path | None = None) -> None:
        if limit_bytes < 0:
            raise ValueError(f"the output log limit must be >= 0 bytes, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._spill_root = spill_dir
        self._spill_dir: Path | None = None
        self._lock = threading.Lock()
        self._entries: dict[Key, _Entry] = {}
        self._seq = itertools.count()
        self.memory_bytes = 0
        self.spilled_bytes = 0
        self.peak_memory_bytes = 0
        self.low = 0  # entries of steps below this were trimmed

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, header: pb.TransferHeader, leaves: Leaves) -> None:
        """Log one value sent to ``header.consumer_node``; a value already logged is replaced."""
        key: Key = (header.consumer_node, header.arg, int(header.step), int(header.microbatch))
        if key[2] < self.low:
            return  # below the cut: no recovery can ask for it
        h = pb.TransferHeader()
        h.CopyFrom(header)
        nbytes = sum(int(np.asarray(x).nbytes) for x in leaves)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._forget(old)
            self._entries[key] = _Entry(h, list(leaves), nbytes)
            self.memory_bytes += nbytes
            self.peak_memory_bytes = max(self.peak_memory_bytes, self.memory_bytes)
            if self.memory_bytes > self.limit_bytes:
                self._spill()

    def trim(self, below_step: int) -> int:
        """Drop every entry of a step below ``below_step`` (the newest consistent cut). Returns how many."""
        with self._lock:
            if below_step <= self.low:
                return 0
            self.low = below_step
            gone = [k for k in self._entries if k[2] < below_step]
            for k in gone:
                self._forget(self._entries.pop(k))
            return len(gone)

    def entries(self, consumers: Iterable[str], from_step: int) -> list[tuple[pb.TransferHeader, Leaves]]:
        """Every logged value for ``consumers`` of a step ``>= from_step``, oldest step first (spilled ones read back)."""
        wanted = set(consumers)
        with self._lock:
            picked = sorted(((k, e) for k, e in self._entries.items() if k[0] in wanted and k[2] >= from_step),
                            key=lambda ke: (ke[0][2], ke[0][3], ke[0][0], ke[0][1]))
            out = []
            for _, e in picked:
                h = pb.TransferHeader()
                h.CopyFrom(e.header)
                out.append((h, e.leaves if e.leaves is not None else self._read(e)))
            return out

    def close(self) -> None:
        """Drop everything, spilled files included."""
        with self._lock:
            self._entries.clear()
            self.memory_bytes = self.spilled_bytes = 0
            if self._spill_dir is not None:
                shutil.rmtree(self._spill_dir, ignore_errors=True)
                self._spill_dir = None

    # -- under the lock ---------------------------------------------------------------------

    def _forget(self, e: _Entry) -> None:
        if e.leaves is None:
            self.spilled_bytes -= e.nbytes
            if e.path is not None:
                shutil.rmtree(e.path, ignore_errors=True)
        else:
            self.memory_bytes -= e.nbytes

    def _spill(self) -> None:
        """Move the oldest in-memory entries to disk until memory is within the limit."""
        if self._spill_dir is None:
            root = self._spill_root
            if root is not None:
                root.mkdir(parents=True, exist_ok=True)
            self._spill_dir = Path(tempfile.mkdtemp(prefix="outlog-", dir=root))
        for key in sorted((k for k, e in self._entries.items() if e.leaves is not None), key=lambda k: (k[2], k[3])):
            if self.memory_bytes <= self.limit_bytes:
                return
            e = self._entries[key]
            assert e.leaves is not None
            path = self._spill_dir / str(next(self._seq))
            path.mkdir()
            for i, leaf in enumerate(e.leaves):
                np.save(path / f"{i}.npy", np.asarray(leaf), allow_pickle=False)
            e.leaves, e.path = None, path
            self.memory_bytes -= e.nbytes
            self.spilled_bytes += e.nbytes

    def _read(self, e: _Entry) -> Leaves:
        assert e.path is not None
        return [np.load(e.path / f"{i}.npy", allow_pickle=False) for i in range(int(e.header.leaves))]
