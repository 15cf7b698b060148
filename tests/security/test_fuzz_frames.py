"""Every parser of a peer's frames, fed random and truncated bytes (hypothesis): the gRPC codec's ``Push`` and
``PushReplica`` streams, the data plane's frames, the member protocol (its frames and its settings) and the
assembly of a multi-host slice's pieces. Each refuses with its one stated error and nothing else, and none
makes the receiver allocate past its stated caps (measured with tracemalloc, against caps made small here):
what a frame *claims* (leaves, shapes, sizes) is checked before anything is made of it.

The pieces of a value complete it only when they cover each element exactly once: overlapping pieces
used to complete a value whose gaps were uninitialized memory, which was delivered.
"""

from __future__ import annotations

import io
import socket
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rallypoint.proto import codec
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers import dataplane
from rallypoint.workers.gang import member
from rallypoint.workers.gang.link import FrameParser, MemberRefused, member_settings
from rallypoint.workers.gang.pieces import PieceAssembler, PieceError

FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CAP = 1 << 16  # the caps the parsers are given here: 64 KiB
SLACK = 1 << 20  # what a parse may allocate besides the value (protobuf, lists, numpy headers)
U32 = struct.Struct("!I")

dtypes = st.sampled_from(["float32", "int8", "uint64", "bool", "complex64", "object", "O", "U4", "V3", "(2,)i4",
                          "i4,f4", "M8[xyz]", "garbage", "", "float1024", "S5"])
shapes = st.lists(st.integers(-3, 1 << 40) | st.integers(0, 9), max_size=4)


@contextmanager
def allocated_at_most(limit: int) -> Iterator[None]:
    """Fails when the block allocates more than ``limit`` bytes at its peak (numpy's buffers are traced too)."""
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= limit, f"the parse allocated {peak} bytes, over {limit}"


def refused_only(call: Callable[[], Any], *errors: type[BaseException]) -> Any:
    try:
        return call()
    except errors:
        return None


# -- the gRPC codec ------------------------------------------------------------------------------------------------

chunk_st = st.builds(lambda leaf, dtype, shape, data: pb.TransferChunk(leaf=leaf, dtype=dtype, shape=shape, data=data),
                     st.integers(-2, 4), dtypes | st.just(""), shapes.filter(lambda s: all(d < 1 << 62 for d in s)),
                     st.binary(max_size=80))


@FUZZ
@given(leaves=st.integers(-5, 1 << 30), chunks=st.lists(chunk_st, max_size=6))
def test_a_push_stream_is_refused_before_it_allocates_what_it_claims(leaves: int, chunks: list[pb.TransferChunk]) -> None:
    stream = [pb.TransferChunk(header=pb.TransferHeader(job="j", leaves=leaves)), *chunks]
    with allocated_at_most(CAP + SLACK):
        got = refused_only(lambda: codec.assemble(iter(stream), max_bytes=CAP, max_leaves=64), ValueError)
    if got is not None:
        _, out = got
        assert len(out) <= 64 and sum(a.nbytes for a in out) <= CAP
        assert all(not a.dtype.hasobject for a in out)


@FUZZ
@given(data=st.binary(max_size=200), cut=st.integers(0, 200))
def test_random_and_truncated_bytes_of_a_replica_stream(data: bytes, cut: int) -> None:
    good = list(codec.replica_chunks(pb.ReplicaHeader(job="j", slice="s", step=1), {"p": [np.arange(6.0)]}))
    wire = [m.SerializeToString() for m in good]
    wire[-1] = wire[-1][:cut]  # a message cut short
    msgs = []
    for raw in [*wire, data]:
        try:
            msgs.append(pb.ReplicaChunk.FromString(raw))  # what gRPC does with the bytes, before our code
        except DecodeError:
            continue
    with allocated_at_most(CAP + SLACK):
        refused_only(lambda: codec.assemble_replica(iter(msgs), max_bytes=CAP), ValueError)


def test_a_push_claiming_a_billion_leaves_is_refused_at_once() -> None:
    stream = [pb.TransferChunk(header=pb.TransferHeader(leaves=1 << 30))]
    with allocated_at_most(SLACK), pytest.raises(ValueError, match="over the limit"):  # main: a list of 2**30 lists
        codec.assemble(iter(stream))


def test_a_replica_stream_over_its_cap_is_refused_as_it_arrives() -> None:
    big = np.zeros(CAP, np.uint8)
    stream = codec.replica_chunks(pb.ReplicaHeader(job="j"), {"p": [big, big]}, chunk_bytes=4096)
    with pytest.raises(ValueError, match="limit"):  # main: no cap on PushReplica at all
        codec.assemble_replica(stream, max_bytes=CAP)


# -- the data plane's frames ---------------------------------------------------------------------------------------

def _tensor(dtype: str, shape: list[int]) -> bytes:
    meta = pb.Tensor(dtype=dtype, shape=shape).SerializeToString()
    return U32.pack(len(meta)) + meta


frames = st.one_of(
    st.binary(max_size=120),
    st.builds(lambda n, metas, tail: U32.pack(len(h := pb.TransferHeader(leaves=n).SerializeToString())) + h
              + b"".join(metas) + tail,
              st.integers(-3, 1 << 20), st.lists(st.builds(_tensor, dtypes, shapes.filter(
                  lambda s: all(d < 1 << 62 for d in s))), max_size=3), st.binary(max_size=40)),
)


@pytest.fixture(scope="module")
def small_data_plane_caps() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dataplane, "MAX_LEAF_BYTES", CAP)
        mp.setattr(dataplane, "MAX_VALUE_BYTES", CAP)
        yield


@FUZZ
@given(frame=frames, cut=st.integers(0, 200))
def test_a_data_plane_frame_is_refused_before_it_allocates_what_it_claims(frame: bytes, cut: int,
                                                                        small_data_plane_caps: None) -> None:
    a, b = socket.socketpair()
    try:
        b.sendall(frame[:cut] if cut < len(frame) else frame)
        b.close()
        with allocated_at_most(CAP + SLACK):
            got = refused_only(lambda: dataplane.DataPlaneServer._read_value(a), dataplane.FrameError, ConnectionError)
    finally:
        a.close()
    if got is not None:
        assert sum(x.nbytes for x in got[1]) <= CAP


# -- the member protocol -------------------------------------------------------------------------------------------

member_frames = st.one_of(
    st.binary(max_size=120),
    st.builds(lambda header, tail: header.encode() + b"\n" + tail,
              st.sampled_from(['{"op": "get", "sizes": [3]}', '{"sizes": [68719476737]}', '{"sizes": [-1]}',
                               '{"sizes": "12"}', '[1]', '{"sizes": [1e30]}', '{"sizes": [true]}', '{"op": 1}',
                               '{"sizes": [' + ",".join(["0"] * 66000) + ']}', "[" * 5000]),
              st.binary(max_size=40)),
)


@settings(FUZZ, max_examples=25)
@given(data=member_frames, split=st.integers(1, 50))
def test_member_frames_are_refused_with_value_error_only(data: bytes, split: int) -> None:
    # What a frame claims never allocates; what arrived may, within a constant factor (a JSON header's list of
    # 2^16 sizes is ~100x its bytes as Python ints).
    with allocated_at_most(4 * SLACK + 150 * len(data)):
        refused_only(lambda: member.read_frame(io.BufferedReader(io.BytesIO(data))), ValueError)  # type: ignore[arg-type]
        parser = FrameParser()
        refused_only(lambda: [parser.feed(data[i:i + split]) for i in range(0, len(data), split)], ValueError)


def test_a_member_frame_claiming_64_gib_allocates_only_what_arrived() -> None:
    r, w = socket.socketpair()
    try:
        w.sendall(b'{"op": "put", "sizes": [68719476000]}\n' + b"x" * 1000)
        w.close()
        with allocated_at_most(3 * SLACK):  # main: a buffered read(n) allocates n at once (or dies of MemoryError)
            assert member.read_frame(r.makefile("rb")) is None
    finally:
        r.close()


@FUZZ
@given(start=st.text(max_size=60) | st.sampled_from(["[" * 3000, '{"processes": 2, "process": 5}', "{}"]))
def test_member_settings_are_refused_with_member_refused_only(start: str) -> None:
    refused_only(lambda: member_settings(start, "127.0.0.1"), MemberRefused)


# -- pieces --------------------------------------------------------------------------------------------------------

SOURCE = np.arange(24, dtype=np.int32).reshape(4, 6)
boxes = st.tuples(st.integers(-1, 4), st.integers(-1, 6), st.integers(0, 5), st.integers(0, 7))


def _piece(box: tuple[int, int, int, int], leaf: int = 0, shape: tuple[int, ...] = SOURCE.shape) -> tuple[pb.Piece, np.ndarray]:
    r, c, h, w = box
    part = SOURCE[max(r, 0):max(r, 0) + h, max(c, 0):max(c, 0) + w]
    return pb.Piece(leaf=leaf, start=[r, c], shape=list(shape)), np.ascontiguousarray(part)


@FUZZ
@given(pieces=st.lists(boxes, min_size=1, max_size=8), leaves=st.integers(-1, 3),
       claimed=st.lists(st.integers(-2, 1 << 40), min_size=2, max_size=2))
@example(pieces=[(0, 0, 0, 0)], leaves=1, claimed=[0, 7])  # a leaf of no elements wider than the source (CI found it)
def test_pieces_deliver_exactly_their_source_or_nothing(pieces: list[tuple[int, int, int, int]], leaves: int,
                                                        claimed: list[int]) -> None:
    asm = PieceAssembler(limit_bytes=CAP)
    out = None
    with allocated_at_most(CAP + SLACK):
        for i, box in enumerate(pieces):
            shape = SOURCE.shape if i % 3 else tuple(claimed)  # now and then a lying whole-leaf shape
            p, x = _piece(box, shape=shape)
            header = pb.TransferHeader(job="j", leaves=1, value_leaves=leaves, pieces=[p])
            got = refused_only(lambda h=header, x=x: asm.add(h, [x]), PieceError)
            out = got if got is not None else out
    if out is not None:  # handed on: every element is the source's at its place (a leaf claimed smaller: its corner)
        assert len(out) == 1 and out[0].ndim == 2
        # An empty leaf (a claimed shape of no elements, however wide) holds nothing to compare.
        assert out[0].size == 0 or np.array_equal(out[0], SOURCE[:out[0].shape[0], :out[0].shape[1]])


def test_overlapping_pieces_never_complete_a_value() -> None:
    asm = PieceAssembler()
    src = np.arange(4, dtype=np.int64)

    def add(start: int, stop: int) -> Any:
        header = pb.TransferHeader(job="j", leaves=1, value_leaves=1,
                                   pieces=[pb.Piece(leaf=0, start=[start], shape=[4])])
        return asm.add(header, [src[start:stop]])

    assert add(0, 2) is None
    with pytest.raises(PieceError, match="overlaps"):  # main: counted 4 elements and delivered [0, 1, 2, garbage]
        add(1, 3)
    assert add(0, 2) is None  # the same piece again (a retried push) is counted once
    assert add(2, 3) is None
    out = add(3, 4)
    assert out is not None and np.array_equal(out[0], src)


def test_a_piece_claiming_a_huge_leaf_is_refused_before_allocating() -> None:
    asm = PieceAssembler(limit_bytes=CAP)
    header = pb.TransferHeader(job="j", leaves=1, value_leaves=1, pieces=[pb.Piece(leaf=0, start=[0], shape=[1 << 40])])
    with allocated_at_most(SLACK), pytest.raises(PieceError, match="limit"):  # main: np.empty of 8 TiB
        asm.add(header, [np.zeros(1, np.float64)])
