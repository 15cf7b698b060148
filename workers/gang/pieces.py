"""Values that arrive in pieces: a multi-host slice's output, sent by each member of its group.

No process of a multi-host slice holds a whole output (docs/multihost.md). When one goes
to a consumer on another worker, every member sends the shards it holds the first
replica of, straight from its own host, as one data-plane frame whose header lists a
:class:`~rallypoint.proto.rallypoint_pb2.Piece` per leaf in it (which leaf of the value,
where it starts, the whole leaf's shape). Together the members' pieces cover every leaf
exactly once. :class:`PieceAssembler` (one per worker) copies each piece into place and
hands the value on, whole, once every leaf is covered; until then a piece is answered
``DELIVERED`` (kept).

A piece that arrives again (the producer's push retried) is counted once. An assembly
whose pieces stop coming (its producer lost midway: the recovery sends the value again
under a new incarnation, another key) is dropped after ``TTL_S``, or first when the
assemblies in progress would pass ``LIMIT_BYTES``.

What a frame claims is checked before anything is made of it: at most ``MAX_LEAVES``
leaves to a value, a whole leaf's claimed shape of at most ``LIMIT_BYTES`` (and the
value's leaves together too), and each piece inside its leaf and overlapping no other
piece of it (a piece sent again is the same start and shape). A value is handed on only
when its pieces cover every element of every leaf exactly once: no byte of uninitialized
memory can be delivered.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rallypoint.proto import rallypoint_pb2 as pb

LIMIT_BYTES = 4 << 30
TTL_S = 300.0
MAX_LEAVES = 1 << 16  # leaves of one value (the data plane's limit on a frame's leaves)


class PieceError(ValueError):
    """A frame's pieces do not fit the value they claim to be part of."""


@dataclass
class _Assembly:
    leaves: int
    arrays: dict[int, np.ndarray] = field(default_factory=dict)
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    seen: dict[int, dict[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)  # leaf -> start -> shape
    covered: dict[int, np.ndarray] = field(default_factory=dict)  # leaf -> which elements a piece filled
    filled: dict[int, int] = field(default_factory=dict)
    at: float = 0.0
    nbytes: int = 0

    def complete(self) -> bool:
        """Every element of every leaf filled by exactly one piece (pieces never overlap: :meth:`PieceAssembler._place`)."""
        return len(self.arrays) == self.leaves and all(
            self.filled[i] == _elements(self.shapes[i]) and bool(self.covered[i].all()) for i in range(self.leaves))


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def whole_header(header: pb.TransferHeader) -> pb.TransferHeader:
    """The header of the value a frame of pieces belongs to: without the pieces, with the value's leaf count."""
    h = pb.TransferHeader()
    h.CopyFrom(header)
    h.ClearField("pieces")
    h.leaves, h.value_leaves = header.value_leaves, 0
    return h


def value_key(header: pb.TransferHeader) -> bytes:
    """The value a piece belongs to (the same for every member's frame of it)."""
    return whole_header(header).SerializeToString(deterministic=True)


class PieceAssembler:
    """The values this worker is receiving in pieces (see the module doc)."""

    def __init__(self, *, limit_bytes: int = LIMIT_BYTES, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_bytes, self.ttl_s, self._clock = limit_bytes, ttl_s, clock
        self._open: OrderedDict[bytes, _Assembly] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def in_progress(self) -> int:
        with self._lock:
            return len(self._open)

    def add(self, header: pb.TransferHeader, leaves: Sequence[np.ndarray]) -> list[np.ndarray] | None:
        """Keep the pieces of one frame; the whole value once its last piece is here (None: not yet).

        Raises:
            PieceError: the pieces do not match the frame's leaves, or do not fit the value.
        """
        if len(header.pieces) != len(leaves):
            raise PieceError(f"the frame lists {len(header.pieces)} pieces for {len(leaves)} leaves")
        n = int(header.value_leaves)
        if n < 1:
            raise PieceError("a value in pieces must say how many leaves it has (TransferHeader.value_leaves)")
        if n > MAX_LEAVES:
            raise PieceError(f"a value of {n} leaves is over the limit of {MAX_LEAVES}")
        key = value_key(header)
        now = self._clock()
        with self._lock:
            self._expire(now)
            a = self._open.get(key)
            if a is None:
                a = self._open[key] = _Assembly(n)
            a.at = now
            if a.leaves != n:
                raise PieceError(f"pieces of one value say {a.leaves} and {n} leaves")
            for piece, x in zip(header.pieces, leaves, strict=True):
                self._place(a, piece, np.asarray(x), self.limit_bytes)
            if a.complete():
                del self._open[key]
                return [a.arrays[i] for i in range(n)]
            self._open.move_to_end(key)
            while sum(o.nbytes for o in self._open.values()) > self.limit_bytes and len(self._open) > 1:
                self._open.popitem(last=False)
        return None

    @staticmethod
    def _place(a: _Assembly, piece: pb.Piece, x: np.ndarray, limit_bytes: int = LIMIT_BYTES) -> None:
        i, start, shape = int(piece.leaf), tuple(int(s) for s in piece.start), tuple(int(s) for s in piece.shape)
        if not 0 <= i < a.leaves:
            raise PieceError(f"piece of leaf {i} of a value of {a.leaves} leaves")
        if len(start) != len(shape) or x.ndim != len(shape) or any(
                s < 0 or n < 0 or s + k > n for s, k, n in zip(start, x.shape, shape, strict=True)):
            raise PieceError(f"a piece {list(x.shape)} at {list(start)} does not fit leaf {i} of shape {list(shape)}")
        if i not in a.arrays:
            need = _elements(shape) * (x.dtype.itemsize + 1)  # the leaf and its coverage mask
            if x.dtype.hasobject or a.nbytes + need > limit_bytes:
                raise PieceError(f"leaf {i} of shape {list(shape)} ({need} bytes with its coverage) takes the value "
                                 f"past the limit of {limit_bytes} bytes")
            a.arrays[i] = np.empty(shape, x.dtype)
            a.covered[i] = np.zeros(shape, np.bool_)
            a.shapes[i], a.seen[i], a.filled[i] = shape, {}, 0
            a.nbytes += a.arrays[i].nbytes + a.covered[i].nbytes
        whole = a.arrays[i]
        if whole.shape != shape or whole.dtype != x.dtype:
            raise PieceError(f"pieces of leaf {i} disagree: {whole.dtype}{list(whole.shape)} and "
                             f"{x.dtype}{list(shape)}")
        if a.seen[i].get(start) == x.shape:
            return  # sent again (a retried push): the same bytes, counted once
        region = tuple(slice(s, s + k) for s, k in zip(start, x.shape, strict=True))
        if a.covered[i][region].any():
            raise PieceError(f"a piece {list(x.shape)} at {list(start)} of leaf {i} overlaps another piece of it")
        whole[region] = x
        a.covered[i][region] = True
        a.seen[i][start] = x.shape
        a.filled[i] += int(x.size)

    def _expire(self, now: float) -> None:
        for k in [k for k, a in self._open.items() if now - a.at > self.ttl_s]:
            del self._open[k]
