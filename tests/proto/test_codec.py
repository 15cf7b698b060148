"""Tensors on the wire: exact round trips, chunking, malformed streams refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rallypoint.proto import codec
from rallypoint.proto import rallypoint_pb2 as pb

DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_, np.float16]


@settings(max_examples=60, deadline=None)
@given(st.lists(hnp.arrays(st.sampled_from(DTYPES), hnp.array_shapes(min_dims=0, max_dims=3, max_side=7)),
                min_size=0, max_size=4),
       st.integers(min_value=1, max_value=64))
def test_chunked_values_come_back_bit_for_bit(leaves: list[np.ndarray], chunk_bytes: int) -> None:
    header, out = codec.assemble(codec.chunks(pb.TransferHeader(job="j", step=3), leaves, chunk_bytes=chunk_bytes))
    assert header.job == "j" and header.step == 3 and header.leaves == len(leaves)
    assert len(out) == len(leaves)
    for a, b in zip(leaves, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()  # bitwise, NaNs included


def test_non_contiguous_and_zero_d_arrays_keep_their_shape() -> None:
    t = np.arange(12, dtype=np.int64).reshape(3, 4).T
    z = np.float32(2.5) * np.ones((), np.float32)
    for a in (t, z):
        back = codec.from_tensor(codec.to_tensor(a))
        assert back.shape == a.shape and np.array_equal(back, a)


def test_a_large_leaf_is_split_into_chunks() -> None:
    leaf = np.ones(1000, np.float32)
    msgs = list(codec.chunks(pb.TransferHeader(job="j"), [leaf], chunk_bytes=1024))
    assert len(msgs) == 1 + 4  # header, then 4000 bytes in 1 KiB chunks
    assert msgs[1].dtype == "float32" and not msgs[2].dtype


def test_malformed_streams_are_refused() -> None:
    with pytest.raises(ValueError, match="header"):
        codec.assemble([pb.TransferChunk(leaf=0, dtype="float32", shape=[1], data=b"\0\0\0\0")])
    with pytest.raises(ValueError, match="never arrived"):
        codec.assemble([pb.TransferChunk(header=pb.TransferHeader(leaves=1))])
    with pytest.raises(ValueError, match="before its dtype"):
        codec.assemble([pb.TransferChunk(header=pb.TransferHeader(leaves=1)), pb.TransferChunk(leaf=0, data=b"x")])
    with pytest.raises(ValueError, match="leaf 5"):
        codec.assemble([pb.TransferChunk(header=pb.TransferHeader(leaves=1)), pb.TransferChunk(leaf=5, dtype="int8")])
