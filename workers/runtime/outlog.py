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
dropped that a recovery could need; the counters say where the bytes are. A spill
off the producer's path may go further down, to :attr:`OutputLog.low_mark`, so the
producer's own spills (which it waits for) are rare.

Where a logged value lives (:mod:`rallypoint.workers.residency`): it is logged as the
:class:`~rallypoint.workers.residency.HostCopy` its pushes share, so it stays on the
device only until its first push copied it off (from then on the log holds the host
copy, and the device buffers are let go); the device bytes held are bounded by the
job's push backlog (back-pressure). A value spilled before its push copied it off is
copied then (counted as ``log_spill``).

No file-system work happens under the log's lock, so a slow or stuck disk holds up
no thread that only logs, trims or counts: :meth:`OutputLog.put` only records (it may
leave the log over its limit), and whoever logged calls :meth:`OutputLog.spill`
afterwards, outside any lock of its own, to write the oldest values out. Reading
spilled values back (:meth:`OutputLog.entries`) and deleting spilled files
(:meth:`OutputLog.trim`, :meth:`OutputLog.close`) also happen outside the lock.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.residency import Copies, HostCopy, host_copy
from rallypoint.workers.runtime.state import Key, Leaves


@dataclass
class _Entry:
    header: pb.TransferHeader
    leaves: HostCopy | None  # None: spilled to ``path``
    nbytes: int
    path: Path | None = None
    spilling: bool = False  # a spill is writing it out (still in memory until it is written)


def _remove(paths: Iterable[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


class OutputLog:
    """Logged outputs of one job on one worker; thread-safe, no file-system work under its lock.

    Args:
        limit_bytes: bytes held in memory before :meth:`spill` moves the oldest entries to disk.
        spill_dir: where spilled entries go (a private temporary directory if None);
            removed by :meth:`close`.
        copies: where the job's host-device copies are counted (None: not counted).
    """

    def __init__(self, limit_bytes: int, *, spill_dir: Path | None = None, copies: Copies | None = None) -> None:
        if limit_bytes < 0:
            raise ValueError(f"the output log limit must be >= 0 bytes, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._spill_root = spill_dir
        self.copies = copies
        self._spill_dir: Path | None = None
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # a spill was written (or failed), a trim or close freed bytes
        self._entries: dict[Key, _Entry] = {}
        self._seq = itertools.count()
        self._spilling_bytes = 0  # in memory, being written out by a spill
        self._closed = False
        self.memory_bytes = 0
        self.spilled_bytes = 0
        self.peak_memory_bytes = 0
        self.low = 0  # entries of steps below this were trimmed

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def over_limit(self) -> bool:
        """Whether more bytes are in memory (and not already being spilled) than the limit allows."""
        return self.over(self.limit_bytes)

    @property
    def low_mark(self) -> int:
        """Where a spill off the producer's path (a push thread's) brings the log down to: a quarter of the limit
        below it, so the producer's next values fit under the limit and its own thread rarely writes a file."""
        return self.limit_bytes - self.limit_bytes // 4

    def over(self, mark: int) -> bool:
        """Whether more bytes are in memory (and not already being spilled) than ``mark``."""
        return self.memory_bytes - self._spilling_bytes > mark

    @property
    def device_bytes(self) -> int:
        """Bytes of logged values still on the device (their pushes have not copied them off yet)."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values() if e.leaves is not None and e.leaves.on_device)

    def put(self, header: pb.TransferHeader, leaves: Leaves | HostCopy) -> None:
        """Log one value sent to ``header.consumer_node``; a value already logged is replaced.

        Only records: when this takes the log over its limit, the caller calls :meth:`spill`
        once it holds no lock.
        """
        key: Key = (header.consumer_node, header.arg, int(header.step), int(header.microbatch))
        if key[2] < self.low:
            return  # below the cut: no recovery can ask for it
        h = pb.TransferHeader()
        h.CopyFrom(header)
        value = host_copy(leaves, self.copies)
        nbytes = value.nbytes
        with self._lock:
            if self._closed:
                return
            old = self._entries.pop(key, None)
            gone = self._forget(old) if old is not None else None
            self._entries[key] = _Entry(h, value, nbytes)
            self.memory_bytes += nbytes
            self.peak_memory_bytes = max(self.peak_memory_bytes, self.memory_bytes)
        if gone is not None:
            _remove([gone])

    def spill(self, down_to: int | None = None, *, settle: bool = False) -> int:
        """Write the oldest in-memory entries to disk until memory is within ``down_to`` bytes (None: the limit);
        returns bytes spilled.

        Call it holding no lock: the writes happen outside the log's lock too (several
        threads may spill at once, each its own entries). An entry another thread is writing
        out counts as gone; ``settle`` (the producer's spill, which keeps the log's bound) also
        waits for those writes until the bytes actually in memory are within the mark.

        Raises:
            OSError: the file system refused a write (the entry stays in memory; a later spill tries again).
        """
        spilled, mark = 0, self.limit_bytes if down_to is None else min(down_to, self.limit_bytes)
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return spilled
                    if self.over(mark):
                        key = min((k for k, e in self._entries.items() if e.leaves is not None and not e.spilling),
                                  key=lambda k: (k[2], k[3]), default=None)
                        if key is None:
                            return spilled
                        break
                    if not settle or self.memory_bytes <= mark:
                        return spilled
                    self._settled.wait(1.0)  # other threads' writes in flight bring it within the mark
                e = self._entries[key]
                e.spilling = True
                self._spilling_bytes += e.nbytes
                value = e.leaves
                assert value is not None
            path: Path | None = None
            try:
                path = self._new_path()
                for i, leaf in enumerate(value.get("log_spill")):
                    np.save(path / f"{i}.npy", leaf, allow_pickle=False)
            except BaseException:
                with self._lock:
                    e.spilling = False
                    self._spilling_bytes -= e.nbytes
                    self._settled.notify_all()
                if path is not None:
                    _remove([path])
                raise
            with self._lock:
                e.spilling = False
                self._spilling_bytes -= e.nbytes
                current = self._entries.get(key) is e and not self._closed
                if current:
                    e.leaves, e.path = None, path
                    self.memory_bytes -= e.nbytes
                    self.spilled_bytes += e.nbytes
                    spilled += e.nbytes
                self._settled.notify_all()
            if not current:  # trimmed or replaced while it was being written
                _remove([path])

    def trim(self, below_step: int) -> int:
        """Drop every entry of a step below ``below_step`` (the newest consistent cut). Returns how many."""
        with self._lock:
            if below_step <= self.low:
                return 0
            self.low = below_step
            gone = [k for k in self._entries if k[2] < below_step]
            paths = [p for k in gone if (p := self._forget(self._entries.pop(k))) is not None]
            self._settled.notify_all()
        _remove(paths)
        return len(gone)

    def entries(self, consumers: Iterable[str], from_step: int) -> list[tuple[pb.TransferHeader, Leaves]]:
        """Every logged value for ``consumers`` of a step ``>= from_step``, oldest step first (spilled ones read back)."""
        return list(self.iter_entries(consumers, from_step))

    def iter_entries(self, consumers: Iterable[str], from_step: int) -> Iterator[tuple[pb.TransferHeader, Leaves]]:
        """:meth:`entries` one value at a time: a spilled value is read back (outside the lock) when its turn comes.

        A value trimmed meanwhile (the cut passed it: nothing can ask for it) is left out.
        """
        wanted = set(consumers)
        with self._lock:
            picked = sorted(((k, e) for k, e in self._entries.items() if k[0] in wanted and k[2] >= from_step),
                            key=lambda ke: (ke[0][2], ke[0][3], ke[0][0], ke[0][1]))
            snapshot = [(k, e.header, e.leaves, e.path) for k, e in picked]
        for key, header, value, path in snapshot:
            if value is not None:
                leaves = value.get("transfer")  # read to be pushed again
            else:
                try:
                    leaves = self._read(path, int(header.leaves))
                except OSError:
                    if key[2] < self.low or self._closed:
                        continue
                    raise
            h = pb.TransferHeader()
            h.CopyFrom(header)
            yield h, leaves

    def close(self) -> None:
        """Drop everything, spilled files included."""
        with self._lock:
            self._closed = True
            self._settled.notify_all()
            self._entries.clear()
            self.memory_bytes = self.spilled_bytes = 0
            spill_dir, self._spill_dir = self._spill_dir, None
        if spill_dir is not None:
            _remove([spill_dir])

    # -- under the lock ---------------------------------------------------------------------

    def _forget(self, e: _Entry) -> Path | None:
        """Take ``e`` out of the counters; the spilled files to remove (outside the lock), if any."""
        if e.leaves is None:
            self.spilled_bytes -= e.nbytes
            return e.path
        self.memory_bytes -= e.nbytes
        return None

    # -- outside the lock -------------------------------------------------------------------

    def _new_path(self) -> Path:
        """A fresh folder for one spilled entry (the spill directory is made on first use)."""
        with self._lock:
            spill_dir, n = self._spill_dir, next(self._seq)
        if spill_dir is None:
            root = self._spill_root
            if root is not None:
                root.mkdir(parents=True, exist_ok=True)
            made = Path(tempfile.mkdtemp(prefix="outlog-", dir=root))
            with self._lock:
                if self._spill_dir is None and not self._closed:
                    self._spill_dir = made
                spill_dir = self._spill_dir
            if spill_dir != made:
                _remove([made])
            if spill_dir is None:
                raise OSError("the output log was closed")
        path = spill_dir / str(n)
        path.mkdir()
        return path

    @staticmethod
    def _read(path: Path | None, leaves: int) -> Leaves:
        assert path is not None
        return [np.load(path / f"{i}.npy", allow_pickle=False) for i in range(leaves)]
