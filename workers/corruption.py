"""The ``corrupt`` fault: a worker that silently computes wrong numbers (silent data corruption).

For tests and the chaos harness only, like every hook of :mod:`rallypoint.workers.faults`: a worker
started with the hidden ``--fault-corrupt-flag PATH`` (``WorkerFaults.corrupt_flag``) reads small JSON
specs from that file, written by ``rallypoint run --fail corrupt:SLICE@STEP`` or the chaos harness's
``corrupt`` fault::

    {"slice": "stage1", "step": 12, "mode": "persist", "worker": "w1", "node": ""}

or a list of such objects. ``mode`` is ``once`` (the first state update of the slice at a step >= ``step``)
or ``persist`` (every state update of the slice from ``step`` on); ``worker`` (optional) names the one
worker that corrupts (empty: any worker holding the slice), ``node`` (optional) the one node whose updates
are corrupted (empty: any node of the slice that updates a state).

A matched update gets one bit flipped in element 0 of its first leaf with an element: the lowest bit (for
floats, the lowest mantissa bit) the first time and, under ``persist``, bit k mod 8 of that element's lowest
byte the k-th time. (One bit flipped at every step can undo itself: an update that adds a whole number to a
float often keeps the lowest bit, and the next flip restores it. A leaf that no update changes still gets its
value back every 16 steps.) The bit is flipped before the value is stored as the state's next version and sent
to its consumers, so everything downstream of it (later steps, checkpoints, the final state) carries the error
and the run ends in another state digest than the reference (unless the job's own arithmetic rounds the error
away). Nothing checks the value here: finding such a worker is the job of a verification (DESIGN.md, "Silent
faults").

A worker without the option has no hook at all (:func:`corruption_hook` returns None), so no file and no
environment variable can arm it. The file is stat-ed at most once per step of each slice (when a state update
of another step than the slice's last comes), and read again only when it changed. A slice of several workers
(a multi-host slice: its values live in its members) is not corrupted; the hook logs that it skipped it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from rallypoint.basics.errors import ConfigError
from rallypoint.basics.logs import get_logger

MODES = ("once", "persist")
KEPT = 100  # corruptions a hook remembers (StateCorruption.corrupted); it counts them all


@dataclass(frozen=True)
class CorruptSpec:
    """Which state updates a worker corrupts (see the module doc)."""

    slice: str
    step: int
    mode: str = "persist"
    worker: str = ""
    node: str = ""

    def __post_init__(self) -> None:
        if not self.slice or not isinstance(self.slice, str):
            raise ConfigError(f"a corrupt spec names a slice, got {self.slice!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ConfigError(f"a corrupt spec's step is a number >= 0, got {self.step!r}")
        if self.mode not in MODES:
            raise ConfigError(f"a corrupt spec's mode is one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.worker, str) or not isinstance(self.node, str):
            raise ConfigError("a corrupt spec's worker and node are names (strings)")

    def matches(self, worker: str, slice_name: str, node: str, step: int) -> bool:
        return (slice_name == self.slice and step >= self.step and (not self.worker or self.worker == worker)
                and (not self.node or self.node == node))


def parse_specs(text: str) -> list[CorruptSpec]:
    """The specs of a flag file: one JSON object, or a list of them.

    Raises:
        ConfigError: not JSON, an unknown key, or a bad value.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"a corrupt flag file holds JSON: {exc}") from None
    items = data if isinstance(data, list) else [data]
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise ConfigError(f"a corrupt spec is a JSON object, got {item!r}")
        unknown = sorted(set(item) - {"slice", "step", "mode", "worker", "node"})
        if unknown:
            raise ConfigError(f"a corrupt spec has unknown keys {unknown}")
        out.append(CorruptSpec(**item))
    return out


def read_specs(path: Path) -> list[CorruptSpec]:
    """The specs in ``path`` (none where it does not exist)."""
    try:
        return parse_specs(Path(path).read_text())
    except FileNotFoundError:
        return []


def write_specs(path: Path, specs: list[CorruptSpec]) -> None:
    """Write ``specs`` to the flag file at once (a reader sees the old file or the new one, never a part)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(json.dumps([asdict(s) for s in specs]))
    os.replace(tmp, path)


def flip_array_bit(a: Any, bit: int = 0) -> np.ndarray:
    """A copy of ``a`` with bit ``bit`` (0 to 7) of the lowest byte of its element 0 flipped: bit 0 is the lowest
    mantissa bit of a float, a bool's only bit (a bool always gets bit 0).

    Raises:
        ValueError: ``a`` has no element, or ``bit`` is not 0 to 7.
    """
    if not 0 <= bit < 8:
        raise ValueError(f"bit {bit}: the lowest byte has bits 0 to 7")
    out = np.array(a, copy=True, order="C")
    if out.size == 0:
        raise ValueError("an array without elements has no bit to flip")
    raw = out.reshape(-1).view(np.uint8)
    big = out.dtype.byteorder == ">" or (out.dtype.byteorder == "=" and sys.byteorder == "big")
    raw[out.dtype.itemsize - 1 if big else 0] ^= 1 << (0 if out.dtype == np.bool_ else bit)
    return out


def _flip_leaf(x: Any, bit: int) -> Any:
    """``x`` with one bit flipped, where it lives (None: it is a value this process does not hold whole)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return flip_array_bit(x, bit)
    import jax

    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:
            return None
        return jax.device_put(flip_array_bit(np.asarray(x), bit), x.sharding)  # back onto the same devices, layout
    return None


def flip_bit(leaves: list[Any], bit: int = 0) -> tuple[list[Any], int | None]:
    """``leaves`` with one bit (:func:`flip_array_bit`) of their first leaf with an element flipped, and its index.

    The leaves given are not changed. Returns the leaves as they are and None when there is nothing this
    process can flip (no leaf with an element, or the first one is held by other processes)."""
    for i, x in enumerate(leaves):
        if int(np.prod(getattr(x, "shape", ()))) == 0:
            continue
        flipped = _flip_leaf(x, bit)
        if flipped is None:
            return list(leaves), None
        return [*leaves[:i], flipped, *leaves[i + 1:]], i
    return list(leaves), None


def _fault(spec: CorruptSpec) -> CorruptSpec:
    """What a spec's fault is, whichever worker it names: ``--fail`` writes a spec before the job is placed (no
    worker) and again naming the worker once it is, and a ``once`` that fired in between must not fire again."""
    return replace(spec, worker="")


class StateCorruption:
    """A worker's ``corrupt`` hook: called with each state update, returns the value to store (see the module doc).

    Args:
        flag: the flag file the specs are read from.
        worker_id: this worker (a spec naming another worker is not this one's).
    """

    def __init__(self, flag: str | Path, worker_id: str) -> None:
        self.flag = Path(flag)
        self.worker_id = worker_id
        self.log = get_logger("rallypoint.faults", worker=worker_id)
        self._lock = threading.Lock()
        self._polled: dict[tuple[str, str], int] = {}  # (job, slice) -> the step the file was last stat-ed at
        self._seen: tuple[int, int, int] | None = None  # the file's (inode, mtime, size) when last read
        self._specs: list[CorruptSpec] = []
        self._spent: set[CorruptSpec] = set()  # the faults (_fault) of "once" specs that fired on this worker
        self._flips: dict[tuple[CorruptSpec, str, str], int] = {}  # (fault, job, slice) -> updates it corrupted
        self.count = 0  # state updates corrupted
        self.corrupted: list[dict[str, Any]] = []  # the first KEPT of them (job, slice, node, step, leaf, mode)

    def _poll(self, job: str, slice_name: str, step: int) -> list[CorruptSpec]:
        if self._polled.get((job, slice_name)) == step:
            return self._specs
        self._polled[job, slice_name] = step
        try:
            st = os.stat(self.flag)
        except OSError:  # no file (yet, or any more): nothing is armed
            self._seen, self._specs = None, []
            return self._specs
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            self._seen = seen
            try:
                self._specs = read_specs(self.flag)
            except (OSError, ConfigError) as exc:
                self._specs = []
                self.log.warning("fault.corrupt_spec_refused", flag=str(self.flag), error=str(exc))
        return self._specs

    def __call__(self, job: str, slice_name: str, node: str, step: int, leaves: list[Any]) -> list[Any]:
        """The value of the state update of ``node`` (on ``slice_name``) at ``step``: ``leaves``, or one bit off."""
        with self._lock:
            spec = next((s for s in self._poll(job, slice_name, step)
                         if s.matches(self.worker_id, slice_name, node, step) and _fault(s) not in self._spent), None)
            if spec is None:
                return leaves
            key = (_fault(spec), job, slice_name)
            bit = self._flips.get(key, 0) % 8
            flipped, leaf = flip_bit(leaves, bit)
            if leaf is None:
                self.log.warning("fault.corrupt_skipped", job=job, slice=slice_name, node=node, step=step,
                                 why="no leaf with an element that this process holds whole")
                return leaves
            if spec.mode == "once":
                self._spent.add(_fault(spec))
            self._flips[key] = self._flips.get(key, 0) + 1
            record = {"job": job, "slice": slice_name, "node": node, "step": step, "leaf": leaf, "bit": bit,
                      "mode": spec.mode}
            self.count += 1
            if len(self.corrupted) < KEPT:
                self.corrupted.append(record)
            self.log.warning("fault.state_corrupted", **record)
            return flipped


def corruption_hook(flag: str, worker_id: str) -> StateCorruption | None:
    """The worker's hook for its ``--fault-corrupt-flag`` (None without one: nothing can arm it)."""
    return StateCorruption(flag, worker_id) if flag else None
