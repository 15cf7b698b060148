"""A multi-host slice's in-memory copies are trusted only through the commit (workers/gang/member_parts.py): each
shard a member rebuilds its values from must be the listing's, which the commit's checksum covers."""

from __future__ import annotations

import numpy as np

from rallypoint.workers.checkpoints.checksums import digest, shard_entries
from rallypoint.workers.gang.member_parts import check_part, shard_key


def _part() -> tuple[dict[str, np.ndarray], list[str], list[dict]]:
    """Member 1's part of a gang of two: rows 4..8 of a row-split leaf, and a replicated leaf whole; the listing
    holds the first replica of each shard (member 0's for the replicated leaf: the same index, the same bytes)."""
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    b = np.arange(6, dtype=np.int32)
    listing = shard_entries([["params", 0, [[0, 4], [0, 4]], "float32", [8, 4], digest(w[:4])],
                             ["params", 0, [[4, 8], [0, 4]], "float32", [8, 4], digest(w[4:])],
                             ["params", 1, [[0, 6]], "int32", [6], digest(b)]])
    shards = {shard_key("params", 0, [[4, 8], [0, 4]]): w[4:].copy(), shard_key("params", 1, [[0, 6]]): b.copy()}
    return shards, list(shards), listing


def test_a_part_whose_shards_are_the_listings_is_taken() -> None:
    shards, need, listing = _part()
    assert check_part(shards, need, listing) == ""


def test_a_flipped_byte_a_missing_shard_or_another_split_is_refused_with_its_reason() -> None:
    shards, need, listing = _part()
    flipped = {k: a.copy() for k, a in shards.items()}
    flipped[need[0]].reshape(-1).view(np.uint8)[0] ^= 0xFF
    assert "not the ones committed" in check_part(flipped, need, listing)
    assert "lacks shard" in check_part({need[1]: shards[need[1]]}, need, listing)
    # a new gang split otherwise needs shards no part holds, and the listing has no such index
    other = shard_key("params", 0, [[0, 8], [0, 2]])
    assert "listing has no shard" in check_part(shards, [other], listing)
    wrong_dtype = dict(shards, **{need[1]: shards[need[1]].astype(np.int64)})
    assert "the commit's is int32[6]" in check_part(wrong_dtype, need, listing)
