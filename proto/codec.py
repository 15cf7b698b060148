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
MAX_LEAVES = 1 << 16
"""The most leaves one stream may say it carries (the data plane's limit too): refused before anything is made."""
MAX_VALUE_BYTES = 1 << 34
"""The most bytes one ``Push`` stream may carry (16 GiB); a ``PushReplica`` is capped lower, by the replica
store's own limit. A stream is refused as soon as what arrived passes its cap, so a peer cannot make the
receiver hold more than the cap, whatever its header claims."""
MAX_NDIM = 32


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


def leaf_meta(dtype: str, shape: Iterable[int], max_bytes: int = MAX_VALUE_BYTES) -> tuple[np.dtype, tuple[int, ...], int]:
    """A leaf's ``(dtype, shape, bytes)`` as a peer declares it, checked before anything is made of it.

    Raises:
        ValueError: an unknown dtype or one that is not plain numeric data (objects, records, sub-arrays), a
            negative dimension, more than ``MAX_NDIM`` dimensions, or more than ``max_bytes`` bytes.
    """
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError) as exc:
        raise ValueError(f"unknown dtype {dtype[:40]!r}: {type(exc).__name__}") from None
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None or dt.kind not in "biufcV":
        raise ValueError(f"dtype {dtype[:40]!r} is not plain numeric data")
    dims = tuple(int(d) for d in shape)
    if len(dims) > MAX_NDIM or any(d < 0 for d in dims):
        raise ValueError(f"bad shape {list(dims)[:MAX_NDIM + 1]}: at most {MAX_NDIM} dimensions, none negative")
    nbytes = dt.itemsize
    for d in dims:
        nbytes *= d
    if nbytes > max_bytes:
        raise ValueError(f"a leaf of {nbytes} bytes is over the limit of {max_bytes}")
    return dt, dims, nbytes


def assemble(messages: Iterable[pb.TransferChunk], *, max_bytes: int = MAX_VALUE_BYTES,
             max_leaves: int = MAX_LEAVES) -> tuple[pb.TransferHeader, list[np.ndarray]]:
    """Rebuild the header and leaves of one ``Push`` stream.

    Nothing is made from what the stream claims before it is checked: at most ``max_leaves`` leaves, each of a
    plain numeric dtype (:func:`leaf_meta`), at most ``max_bytes`` bytes in all (counted as they arrive), and
    each leaf's bytes exactly its shape's.

    Raises:
        ValueError: the stream is malformed (no header, missing or out-of-order leaves, a bad dtype or shape,
            bytes that do not fill the shape) or over a cap.
    """
    it = iter(messages)
    first = next(it, None)
    if first is None or not first.HasField("header"):
        raise ValueError("transfer stream does not start with a header")
    header = first.header
    if header.leaves > max_leaves:
        raise ValueError(f"a value of {header.leaves} leaves is over the limit of {max_leaves}")
    parts: list[list[bytes]] = [[] for _ in range(header.leaves)]
    meta: list[tuple[np.dtype, tuple[int, ...], int] | None] = [None] * header.leaves
    got = [0] * header.leaves
    total = 0
    for msg in it:
        if not 0 <= msg.leaf < header.leaves:
            raise ValueError(f"chunk for leaf {msg.leaf} of a {header.leaves}-leaf value")
        if msg.dtype:
            if meta[msg.leaf] is not None:
                raise ValueError(f"leaf {msg.leaf}: its dtype and shape sent twice")
            meta[msg.leaf] = leaf_meta(msg.dtype, msg.shape, max_bytes)
        elif meta[msg.leaf] is None:
            raise ValueError(f"leaf {msg.leaf}: data before its dtype and shape")
        m = meta[msg.leaf]
        assert m is not None
        got[msg.leaf] += len(msg.data)
        total += len(msg.data)
        if got[msg.leaf] > m[2]:
            raise ValueError(f"leaf {msg.leaf}: more than the {m[2]} bytes of its shape {list(m[1])}")
        if total > max_bytes:
            raise ValueError(f"the value passed the limit of {max_bytes} bytes")
        parts[msg.leaf].append(msg.data)
    leaves = []
    for i, m in enumerate(meta):
        if m is None:
            raise ValueError(f"leaf {i} never arrived")
        dtype, shape, nbytes = m
        if got[i] != nbytes:
            raise ValueError(f"leaf {i}: {got[i]} bytes for the {nbytes} of its shape {list(shape)}")
        buf = parts[i][0] if len(parts[i]) == 1 else b"".join(parts[i])
        leaves.append(np.frombuffer(buf, dtype=dtype).reshape(shape))
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


def assemble_replica(messages: Iterable[pb.ReplicaChunk], *, max_bytes: int = MAX_VALUE_BYTES,
                     ) -> tuple[pb.ReplicaHeader, dict[str, list[np.ndarray]]]:
    """Rebuild the header and ``{state: [leaves]}`` of one replica stream (capped as :func:`assemble`).

    Raises:
        ValueError: the stream is malformed (no header, leaf counts that do not add up, missing leaves) or over
            a cap.
    """
    it = iter(messages)
    first = next(it, None)
    if first is None or not first.HasField("header"):
        raise ValueError("replica stream does not start with a header")
    header = first.header
    if len(header.states) != len(header.state_leaves):
        raise ValueError(f"replica header names {len(header.states)} states but {len(header.state_leaves)} leaf counts")
    if len(set(header.states)) != len(header.states) or any(n < 0 for n in header.state_leaves):
        raise ValueError("replica header names a state twice, or a negative leaf count")
    _, leaves = assemble(itertools.chain([first.chunk], (m.chunk for m in it)), max_bytes=max_bytes)
    if len(leaves) != sum(header.state_leaves):
        raise ValueError(f"replica of {sum(header.state_leaves)} leaves carried {len(leaves)}")
    out: dict[str, list[np.ndarray]] = {}
    at = 0
    for name, n in zip(header.states, header.state_leaves):
        out[name], at = leaves[at:at + n], at + n
    return header, out
