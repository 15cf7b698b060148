"""Step-indexed batches for host sources: ``(step, microbatch)`` -> which records, through Grain.

A host source (``prog.source(..., host=True)``) must read the same examples for the same
``(step, microbatch)`` every time: on a replay after a loss, after a slice shrank or grew,
on any device count. The helpers here make the record indices a pure function of
``(step, microbatch)`` and a few fixed numbers, never of the devices or of what was read
before, so a source built on them is deterministic by construction.

Positions: the examples of the whole run form one stream; example ``j`` of microbatch
``mb`` of step ``s`` sits at position ``(s * microbatches + mb) * batch + j``. So a step's
examples are the positions ``[s * B, (s + 1) * B)`` with ``B = batch * microbatches``,
cut into microbatches in order: a job that splits its step into more microbatches of
fewer examples reads the same examples in the same order. Devices never enter: the
source returns the whole (micro)batch and the runtime lays it out over the slice.

Epochs: position ``p`` is record ``order[p // records][p % records]``, where epoch ``e``
is a permutation of all ``records`` records. The permutation is Grain's
(``grain.MapDataset.range(records).shuffle(seed=seed).repeat()``, random access): Grain
shuffles epoch ``e`` with seed ``seed + e`` (grain 0.2.18, ``ShuffleMapDataset``), so every
epoch has its own order and every record comes exactly once per epoch; a batch may
straddle two epochs. (A consequence of Grain's rule: epoch 1 under seed ``s`` is epoch 0
under seed ``s + 1``; use seeds far apart for different runs if that matters.)

    batches = GrainBatches(TokenWindows(tokens, context=64), batch=16, microbatches=2, seed=0)
    batches(step, microbatch)  # {"inputs": int32 (16, 64), "targets": int32 (16, 64)}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rallypoint.basics.errors import RallypointError

SEED_LIMIT = 2**32  # Grain's shuffle seeds are 32-bit


class DataError(RallypointError, ValueError):
    """A bad argument to a data helper; the message names it."""


def _count(name: str, value: Any, *, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise DataError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _seed(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < SEED_LIMIT:
        raise DataError(f"seed must be an integer in [0, 2**32), got {value!r}")
    return int(value)


def positions(step: int, microbatch: int, *, batch: int, microbatches: int) -> np.ndarray:
    """The stream positions of the examples of ``(step, microbatch)``: ``batch`` consecutive int64s."""
    batch = _count("batch", batch)
    microbatches = _count("microbatches", microbatches)
    step = _count("step", step, low=0)
    microbatch = _count("microbatch", microbatch, low=0)
    if microbatch >= microbatches:
        raise DataError(f"microbatch {microbatch} is out of range: the step has {microbatches} microbatches "
                        f"(0..{microbatches - 1})")
    start = (step * microbatches + microbatch) * batch
    return np.arange(start, start + batch, dtype=np.int64)


def _shuffled(records: int, seed: int) -> Any:
    """Grain's random-access view of every epoch's order of ``range(records)``."""
    import grain

    if records >= SEED_LIMIT:  # Grain's index shuffle works on 32-bit indices
        raise DataError(f"records must be below 2**32, got {records}")
    return grain.MapDataset.range(records).shuffle(seed=seed).repeat()


def record_indices(step: int, microbatch: int, *, batch: int, microbatches: int, records: int,
                   seed: int) -> np.ndarray:
    """The record indices of ``(step, microbatch)``: ``batch`` int64s in ``[0, records)``.

    A pure function of its arguments: the same indices on every call, in every process,
    on any device count (see the module's doc for the layout and the epochs).

    Raises:
        DataError: an argument is not a valid count, the microbatch is out of range, or the
            seed is not a 32-bit unsigned integer.
    """
    records = _count("records", records)
    seed = _seed(seed)
    pos = positions(step, microbatch, batch=batch, microbatches=microbatches)
    order = _shuffled(records, seed)
    return np.fromiter((order[int(p)] for p in pos), dtype=np.int64, count=len(pos))


def epoch_of(step: int, microbatch: int = 0, *, batch: int, microbatches: int, records: int) -> int:
    """The epoch of the first example of ``(step, microbatch)`` (0-based)."""
    records = _count("records", records)
    return int(positions(step, microbatch, batch=batch, microbatches=microbatches)[0]) // records


def stack_records(items: Sequence[Any]) -> Any:
    """Records (dicts of arrays, or arrays) stacked on a new axis 0, as NumPy."""
    first = items[0]
    if isinstance(first, Mapping):
        return {k: np.stack([np.asarray(it[k]) for it in items]) for k in first}
    return np.stack([np.asarray(it) for it in items])


class GrainBatches:
    """A host source over a random-access dataset: ``(step, microbatch)`` -> the stacked records.

    Args:
        source: anything Grain's ``MapDataset.source`` takes (a sequence with ``len`` and
            ``[i]``: a NumPy array, :class:`TokenWindows`, an ``ArrayRecordDataSource``), or a
            ``grain.MapDataset``. A callable returning one is opened on first use (so a
            module-level ``GrainBatches`` costs nothing at import, e.g. on a worker).
        batch: examples per microbatch.
        microbatches: microbatches per step (1 for a ``per="step"`` source).
        seed: the shuffle seed.
        transform: applied to the stacked batch (e.g. a dtype cast); must be deterministic.

    ``batches(step, microbatch)`` returns the records of :func:`record_indices` for the
    same arguments, stacked on axis 0 (a dict of arrays if records are dicts).
    """

    def __init__(self, source: Any, *, batch: int, microbatches: int = 1, seed: int,
                 transform: Callable[[Any], Any] | None = None) -> None:
        self.batch = _count("batch", batch)
        self.microbatches = _count("microbatches", microbatches)
        self.seed = _seed(seed)
        self.transform = transform
        self._source = source
        self._dataset: Any = None
        self.records = 0

    def dataset(self) -> Any:
        """The shuffled, repeated Grain dataset (opened on first use)."""
        if self._dataset is None:
            import grain

            src = self._source() if callable(self._source) and not hasattr(self._source, "__len__") else self._source
            base = src if isinstance(src, grain.MapDataset) else grain.MapDataset.source(src)
            self.records = len(base)
            if self.records < 1:
                raise DataError("the data source holds no records")
            if self.records >= SEED_LIMIT:
                raise DataError(f"records must be below 2**32, got {self.records}")
            self._dataset = base.shuffle(seed=self.seed).repeat()
        return self._dataset

    def indices(self, step: int, microbatch: int) -> np.ndarray:
        """The record indices this source reads for ``(step, microbatch)``."""
        self.dataset()
        return record_indices(step, microbatch, batch=self.batch, microbatches=self.microbatches,
                              records=self.records, seed=self.seed)

    def __call__(self, step: int, microbatch: int) -> Any:
        ds = self.dataset()
        pos = positions(int(step), int(microbatch), batch=self.batch, microbatches=self.microbatches)
        out = stack_records([ds[int(p)] for p in pos])
        return self.transform(out) if self.transform is not None else out


class TokenWindows:
    """Fixed windows of a 1-D token array as records: ``{"inputs": w[:-1], "targets": w[1:]}``.

    Record ``i`` is tokens ``[i * context, i * context + context + 1)`` (windows overlap by the
    one token that is the last target of one and the first input of the next). ``tokens`` is an
    array or the path of a ``.npy`` file, memory-mapped on first use. Records are int32.
    """

    def __init__(self, tokens: np.ndarray | str | Path, *, context: int) -> None:
        self.context = _count("context", context)
        self._tokens = tokens if isinstance(tokens, np.ndarray) else None
        self._path = None if isinstance(tokens, np.ndarray) else Path(tokens)

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            assert self._path is not None
            self._tokens = np.load(self._path, mmap_mode="r")
        if self._tokens.ndim != 1:
            raise DataError(f"tokens must be a 1-D array, got shape {self._tokens.shape}")
        return self._tokens

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.context)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"window {i} out of range ({n} windows)")
        i %= n
        w = np.asarray(self.tokens[i * self.context : (i + 1) * self.context + 1], dtype=np.int32)
        return {"inputs": w[:-1], "targets": w[1:]}
