"""Step-indexed batches through Grain (client/data.py): the same records for the same (step, microbatch)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from rallypoint.client.data import (
    DataError,
    GrainBatches,
    TokenWindows,
    epoch_of,
    positions,
    record_indices,
)


def indices(step: int, mb: int = 0, *, batch: int = 4, microbatches: int = 1, records: int = 10,
            seed: int = 7) -> list[int]:
    return record_indices(step, mb, batch=batch, microbatches=microbatches, records=records, seed=seed).tolist()


def test_same_indices_for_the_same_step_and_microbatch() -> None:
    first = [indices(s, mb, microbatches=3) for s in range(5) for mb in range(3)]
    again = [indices(s, mb, microbatches=3) for s in reversed(range(5)) for mb in reversed(range(3))][::-1]
    assert first == again  # the order of the calls (a replay, a prefetch) does not matter
    assert first[0] != first[1]  # ... but the step and microbatch do
    assert indices(0, seed=7) != indices(0, seed=8)


def test_every_record_once_per_epoch_and_a_new_order_each_epoch() -> None:
    records, batch = 10, 5
    stream = [i for s in range(6) for i in indices(s, batch=batch, records=records)]  # three epochs
    epochs = [stream[e * records:(e + 1) * records] for e in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(records))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert [epoch_of(s, batch=batch, microbatches=1, records=records) for s in range(6)] == [0, 0, 1, 1, 2, 2]


def test_a_batch_straddling_an_epoch_boundary() -> None:
    records, batch = 10, 4  # step 2 holds positions 8..11: the last two of epoch 0, the first two of epoch 1
    stream = [i for s in range(5) for i in indices(s, batch=batch, records=records)]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert indices(2, batch=batch, records=records) == stream[8:12]


def test_the_step_reads_the_same_examples_however_it_is_cut_into_microbatches() -> None:
    """Independent of devices and of the microbatch split: a step is positions [s*B, (s+1)*B)."""
    whole = indices(3, batch=12, microbatches=1, records=50)
    for m in (2, 3, 4, 6):
        assert [i for mb in range(m) for i in indices(3, mb, batch=12 // m, microbatches=m, records=50)] == whole


def test_grain_batches_match_record_indices_and_repeat_exactly() -> None:
    tokens = (np.arange(401) * 7 % 256).astype(np.uint8)
    windows = TokenWindows(tokens, context=8)
    assert len(windows) == 50
    batches = GrainBatches(windows, batch=6, microbatches=2, seed=3)
    for step, mb in [(0, 0), (0, 1), (9, 1), (40, 0)]:  # step 40 is in epoch 9
        got = batches(step, mb)
        idx = record_indices(step, mb, batch=6, microbatches=2, records=50, seed=3)
        assert got["inputs"].dtype == np.int32 and got["inputs"].shape == (6, 8)
        np.testing.assert_array_equal(got["inputs"], np.stack([windows[int(i)]["inputs"] for i in idx]))
        np.testing.assert_array_equal(got["targets"][:, :-1], got["inputs"][:, 1:])
        again = GrainBatches(windows, batch=6, microbatches=2, seed=3)(step, mb)  # a fresh process's view
        assert all(np.array_equal(got[k], again[k]) for k in got)


def test_token_windows_read_a_memory_mapped_file_lazily(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "tokens.npy"
    batches = GrainBatches(lambda: TokenWindows(path, context=4), batch=2, seed=0)  # nothing is read yet
    np.save(path, np.arange(21, dtype=np.uint8))
    out = batches(0, 0)
    assert batches.records == 5
    assert out["inputs"].shape == (2, 4)
    assert all(((row[1:] - row[:-1]) == 1).all() for row in out["inputs"])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batch": 0}, "batch must be an integer >= 1"),
    ({"microbatches": 2, "mb": 2}, "microbatch 2 is out of range"),
    ({"step": -1}, "step must be an integer >= 0"),
    ({"records": 0}, "records must be an integer >= 1"),
    ({"seed": -1}, "seed must be an integer in [0, 2**32)"),
    ({"seed": 2**32}, "seed must be an integer in [0, 2**32)"),
    ({"batch": 2.0}, "batch must be an integer"),
])
def test_a_bad_argument_is_a_clear_error(kwargs, message) -> None:  # type: ignore[no-untyped-def]
    args = {"step": 0, "mb": 0, "batch": 4, "microbatches": 1, "records": 10, "seed": 0} | kwargs
    with pytest.raises(DataError, match=re.escape(message)):
        record_indices(args["step"], args["mb"], batch=args["batch"], microbatches=args["microbatches"],
                       records=args["records"], seed=args["seed"])


def test_an_empty_source_is_a_clear_error() -> None:
    with pytest.raises(DataError, match="holds no records"):
        GrainBatches(TokenWindows(np.zeros(3, np.uint8), context=4), batch=1, seed=0)(0, 0)


def test_positions_are_consecutive_per_step() -> None:
    assert positions(2, 1, batch=3, microbatches=2).tolist() == [15, 16, 17]
