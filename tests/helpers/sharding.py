"""What each device holds of a set of arrays: the sharded-state tests' measure of a layout."""

from __future__ import annotations

from typing import Any

import jax


def per_device_bytes(leaves: Any) -> dict[Any, int]:
    """Bytes each device holds of ``leaves`` (a pytree of ``jax.Array``), every addressable shard on its device."""
    held: dict[Any, int] = {}
    for x in jax.tree_util.tree_leaves(leaves):
        for s in x.addressable_shards:
            held[s.device] = held.get(s.device, 0) + int(s.data.nbytes)
    return held
