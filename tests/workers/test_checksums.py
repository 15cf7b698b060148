"""The two kinds of checkpoint checksum: whole leaves (one worker), and a multi-host slice's shard listing,
which whole leaves read back in one process must match whatever their layout (workers/checkpoints/checksums.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rallypoint.workers.checkpoints.checksums import (SHARDED, SHARDS_FILE, checksum_of, digest, shard_entries,
                                          shards_checksum, state_checksum)


def _states() -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return {"params": [rng.standard_normal((8, 4)).astype(np.float32), np.arange(6, dtype=np.int32)],
            "opt": [np.float32(3.5) * np.ones((), np.float32)]}


def _saved(states: dict[str, list[np.ndarray]], tmp: Path) -> str:
    """What members of a gang of two would have answered: params[0] split by rows between them, the rest held
    whole by the first (its first replica); written and committed as GangSteps does."""
    w, b = states["params"]
    rows = [["params", 0, [[0, 4], [0, 4]], "float32", [8, 4], digest(w[0:4])],
            ["params", 0, [[4, 8], [0, 4]], "float32", [8, 4], digest(w[4:8])],
            ["params", 1, [[0, 6]], "int32", [6], digest(b)],
            ["opt", 0, [], "float32", [], digest(states["opt"][0])]]
    entries = shard_entries(reversed(rows))  # the members answer in any order
    (tmp / SHARDS_FILE).write_text(json.dumps(entries))
    return shards_checksum(entries)


def test_a_sharded_checksum_is_checked_against_whole_leaves_read_back_in_one_process(tmp_path: Path) -> None:
    states = _states()
    committed = _saved(states, tmp_path)
    assert committed.startswith(SHARDED) and committed != state_checksum(states)
    assert checksum_of(states, committed, tmp_path) == committed
    # one flipped bit in one shard is seen
    bad = {k: [a.copy() for a in v] for k, v in states.items()}
    bad["params"][0][5, 2] = np.nextafter(bad["params"][0][5, 2], np.float32(9))
    assert checksum_of(bad, committed, tmp_path) != committed
    # a leaf of another dtype or shape, or a missing state, is not what was saved
    assert checksum_of(states | {"params": [states["params"][0].astype(np.float64), states["params"][1]]},
                       committed, tmp_path) != committed
    assert checksum_of({"params": states["params"]}, committed, tmp_path) != committed
    # the whole-leaf kind is unchanged
    assert checksum_of(states, state_checksum(states), None) == state_checksum(states)


def test_a_listing_that_is_missing_altered_or_does_not_cover_each_leaf_once_fails_the_check(tmp_path: Path) -> None:
    states = _states()
    committed = _saved(states, tmp_path)
    listing = json.loads((tmp_path / SHARDS_FILE).read_text())
    # altered after the commit (a digest replaced by the one of the bytes now there): the listing's own sum differs
    listing[0]["sha256"] = digest(np.zeros(1))
    (tmp_path / SHARDS_FILE).write_text(json.dumps(listing))
    assert checksum_of(states, committed, tmp_path).startswith("none: shards.json does not match")
    # a listing that leaves rows out, committed as it is: every leaf must be covered exactly once
    short = [e for e in json.loads(json.dumps(listing)) if e["index"] != [[4, 8], [0, 4]]]
    (tmp_path / SHARDS_FILE).write_text(json.dumps(short))
    assert "exactly once" in checksum_of(states, shards_checksum(short), tmp_path)
    (tmp_path / SHARDS_FILE).unlink()
    assert checksum_of(states, committed, tmp_path).startswith("none: shards.json unreadable")
