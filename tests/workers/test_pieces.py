"""A multi-host slice's output arrives in pieces, one frame per member, and is handed on whole only once every
leaf is covered (workers/gang/pieces.py; pure logic: the members' frames on a real cluster are in
tests/integration/test_gang_runtime.py)."""

from __future__ import annotations

import numpy as np
import pytest

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.gang.pieces import PieceAssembler, PieceError, whole_header


def _frame(pieces: list[tuple[int, list[int], list[int]]], value_leaves: int = 2, step: int = 3) -> pb.TransferHeader:
    h = pb.TransferHeader(job="j", node="fwd", output="h", step=step, microbatch=-1, consumer_node="sum", arg="h",
                          to=pb.Identity(worker_id="w2", incarnation=4), from_worker="w0", from_incarnation=1,
                          leaves=len(pieces), value_leaves=value_leaves)
    h.pieces.extend(pb.Piece(leaf=leaf, start=start, shape=shape) for leaf, start, shape in pieces)
    return h


def test_each_members_pieces_make_the_value_whole_once_every_leaf_is_covered_and_a_resent_piece_counts_once() -> None:
    h = np.arange(32, dtype=np.float32).reshape(8, 4)
    loss = np.float32(0.5)
    a = PieceAssembler()
    # member 0: rows 0..4 of leaf 0 and the scalar leaf 1 (its first replica); member 1: rows 4..8
    assert a.add(_frame([(0, [0, 0], [8, 4]), (1, [], [])]), [h[:4], np.asarray(loss)]) is None
    assert a.add(_frame([(0, [0, 0], [8, 4]), (1, [], [])]), [h[:4], np.asarray(loss)]) is None  # a retried push
    assert a.in_progress == 1
    whole = a.add(_frame([(0, [4, 0], [8, 4])]), [h[4:]])
    assert whole is not None and a.in_progress == 0
    np.testing.assert_array_equal(whole[0], h)
    assert whole[1].shape == () and whole[1] == loss
    # the value is handed on under the header it was sent as: no pieces, its own leaf count
    w = whole_header(_frame([(0, [4, 0], [8, 4])]))
    assert (w.leaves, w.value_leaves, len(w.pieces), w.step) == (2, 0, 0, 3)


def test_pieces_of_other_values_are_kept_apart() -> None:
    a = PieceAssembler()
    x = np.ones((2, 2), np.int32)
    assert a.add(_frame([(0, [0, 0], [4, 2])], value_leaves=1, step=1), [x]) is None
    assert a.add(_frame([(0, [2, 0], [4, 2])], value_leaves=1, step=2), [x]) is None  # step 2's, not step 1's
    assert a.in_progress == 2
    assert a.add(_frame([(0, [2, 0], [4, 2])], value_leaves=1, step=1), [x * 2]) is not None


@pytest.mark.parametrize(("pieces", "leaves", "says"), [
    ([(0, [0, 0], [8, 4])], [np.zeros((4, 4)), np.zeros(1)], "lists 1 pieces for 2 leaves"),
    ([(2, [0, 0], [8, 4])], [np.zeros((4, 4))], "piece of leaf 2 of a value of 2 leaves"),
    ([(0, [6, 0], [8, 4])], [np.zeros((4, 4))], "does not fit leaf 0 of shape [8, 4]"),
    ([(0, [0], [8, 4])], [np.zeros((4, 4))], "does not fit"),
])
def test_a_piece_that_does_not_fit_its_value_is_refused(pieces: list, leaves: list, says: str) -> None:
    with pytest.raises(PieceError, match=says.replace("[", r"\[").replace("]", r"\]")):
        PieceAssembler().add(_frame(pieces), leaves)


def test_pieces_that_disagree_or_overlap_are_refused_and_an_abandoned_value_expires() -> None:
    d = PieceAssembler()
    d.add(_frame([(0, [0, 0], [8, 4])], value_leaves=1), [np.zeros((4, 4), np.float32)])
    with pytest.raises(PieceError, match="disagree"):
        d.add(_frame([(0, [4, 0], [8, 4])], value_leaves=1), [np.zeros((4, 4), np.int32)])
    now = [0.0]
    a = PieceAssembler(ttl_s=60.0, clock=lambda: now[0])
    a.add(_frame([(0, [0, 0], [8, 4])], value_leaves=1), [np.zeros((4, 4), np.float32)])
    b = PieceAssembler()
    b.add(_frame([(0, [0, 0], [8, 4])], value_leaves=1), [np.zeros((4, 4), np.float32)])
    with pytest.raises(PieceError, match="overlap"):
        b.add(_frame([(0, [2, 0], [8, 4])], value_leaves=1), [np.zeros((6, 4), np.float32)])
    with pytest.raises(PieceError, match="value_leaves"):
        PieceAssembler().add(_frame([(0, [0, 0], [8, 4])], value_leaves=0), [np.zeros((4, 4))])
    now[0] = 59.0
    a.add(_frame([(0, [0, 0], [2, 2])], value_leaves=1, step=8), [np.zeros((1, 2))])
    assert a.in_progress == 2  # within the TTL: both kept
    now[0] = 61.0
    a.add(_frame([(0, [0, 0], [2, 2])], value_leaves=1, step=9), [np.zeros((1, 2))])  # expires the first
    assert a.in_progress == 2
