"""Tensors on the wire: numpy arrays <-> ``Tensor`` messages and chunked transfers.

A value (a pytree's flat leaves) moves as one ``Push`` stream: the header first,
then each leaf's raw bytes in chunks of at most ``CHUNK_BYTES``. Buffers are sliced
with memoryviews, not copied, on the way out; on the way in, each leaf's chunks are
joined once into the array's buffer.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from rallypoint.proto import rallypoint_pb2 as pb

CHUNK_BYTES = 1 << 20


def _c_order(array: np.ndarray) -> np.ndarray:
    # Not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
    a = np.asarray(array)
    return a if a.flags.c_contiguous else np.array(a, order="C")


def to_tensor(array: np.ndarray) -> pb.Tensor:
    """One array as a ``Tensor`` message (C-order bytes)."""
    a = _c_order(array)
    return pb.Tensor(dtype=a.dtype.name, shape=a.shape, data=a.tobytes())


def from_tensor(t: pb.Tensor) -> np.ndarray:
    """A ``Tensor`` message as a (read-only) numpy array."""
    return np.frombuffer(t.data, dtype=np.dtype(t.dtype)).reshape(tuple(t.shape))


def chunks(header: pb.TransferHeader, leaves: Sequence[np.ndarray], chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.TransferChunk]:
    """The messages of one ``Push`` stream: header, then every leaf in chunks."""
    header.leaves = len(leaves)
    yield pb.TransferChunk(header=header)
    for i, leaf in enumerate(leaves):
        a = _c_order(leaf)
        view = memoryview(a).cast("B") if a.nbytes else memoryview(b"")
        first = True
        for start in range(0, max(a.nbytes, 1), chunk_bytes):
            part = view[start : start + chunk_bytes]
            if first:
                yield pb.TransferChunk(leaf=i, dtype=a.dtype.name, shape=a.shape, data=bytes(part))
                first = False
            else:
                yield pb.TransferChunk(leaf=i, data=bytes(part))


def assemble(messages: Iterable[pb.TransferChunk]) -> tuple[pb.TransferHeader, list[np.ndarray]]:
    """Rebuild the header and leaves of one ``Push`` stream.

    Raises:
        ValueError: the stream is malformed (no header, missing or out-of-order leaves).
    """
    it = iter(messages)
    first = next(it, None)
    if first is None or not first.HasField("header"):
        raise ValueError("transfer stream does not start with a header")
    header = first.header
    parts: list[list[bytes]] = [[] for _ in range(header.leaves)]
    meta: list[tuple[str, tuple[int, ...]] | None] = [None] * header.leaves
    for msg in it:
        if not 0 <= msg.leaf < header.leaves:
            raise ValueError(f"chunk for leaf {msg.leaf} of a {header.leaves}-leaf value")
        if msg.dtype:
            meta[msg.leaf] = (msg.dtype, tuple(msg.shape))
        elif meta[msg.leaf] is None:
            raise ValueError(f"leaf {msg.leaf}: data before its dtype and shape")
        parts[msg.leaf].append(msg.data)
    leaves = []
    for i, m in enumerate(meta):
        if m is None:
            raise ValueError(f"leaf {i} never arrived")
        dtype, shape = m
        buf = parts[i][0] if len(parts[i]) == 1 else b"".join(parts[i])
        leaves.append(np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape))
    return header, leaves


def replica_chunks(header: pb.ReplicaHeader, states: dict[str, Sequence[np.ndarray]],
                   chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.ReplicaChunk]:
    """The messages of one ``PushReplica`` / ``FetchReplica`` stream: the header (with the
    state names and leaf counts, in name order), then every leaf chunked as in a ``Push``."""
    names = sorted(states)
    del header.states[:], header.state_leaves[:]
    header.states.extend(names)
    header.state_leaves.extend(len(states[n]) for n in names)
    leaves = [leaf for n in names for leaf in states[n]]
    for i, c in enumerate(chunks(pb.TransferHeader(), leaves, chunk_bytes)):
        yield pb.ReplicaChunk(header=header, chunk=c) if i == 0 else pb.ReplicaChunk(chunk=c)


def assemble_replica(messages: Iterable[pb.ReplicaChunk]) -> tuple[pb.ReplicaHeader, dict[str, list[np.ndarray]]]:
    """Rebuild the header and ``{state: [leaves]}`` of one replica stream.

    Raises:
        ValueError: the stream is malformed (no header, leaf counts that do not add up, missing leaves).
    """
    it = iter(messages)
    first = next(it, None)
    if first is None or not first.HasField("header"):
        raise ValueError("replica stream does not start with a header")
    header = first.header
    if len(header.states) != len(header.state_leaves):
        raise ValueError(f"replica header names {len(header.states)} states but {len(header.state_leaves)} leaf counts")
    _, leaves = assemble(itertools.chain([first.chunk], (m.chunk for m in it)))
    if len(leaves) != sum(header.state_leaves):
        raise ValueError(f"replica of {sum(header.state_leaves)} leaves carried {len(leaves)}")
    out: dict[str, list[np.ndarray]] = {}
    at = 0
    for name, n in zip(header.states, header.state_leaves):
        out[name], at = leaves[at:at + n], at + n
    return header, out
