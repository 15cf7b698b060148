"""The state digest over flat leaves as they travel on the wire.

``sha256`` over every state in name order: the name and its pytree structure (as
JAX prints it), then each leaf's dtype, shape and bytes. :func:`rallypoint.client.reference.state_digest`
computes the same from the pytrees, so the coordinator can report the digest of a
job whose client holds no program (``rallypoint resume``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rallypoint.proto import codec
from rallypoint.proto import rallypoint_pb2 as pb


def leaves_digest(states: Iterable[tuple[str, str, Sequence[Any]]]) -> str:
    """The digest of ``(name, treedef string, leaves)`` per state (any order)."""
    h = hashlib.sha256()
    for name, treedef, leaves in sorted(states, key=lambda t: t[0]):
        h.update(f"{name}\0{treedef}\0".encode())
        for leaf in leaves:
            a = np.ascontiguousarray(np.asarray(leaf))
            h.update(f"{a.dtype}\0{a.shape}\0".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def flat_state_digest(values: Sequence[pb.StateValue], treedefs: Mapping[str, str]) -> str:
    """The digest of final states as ``FetchState`` returns them; "" when a structure is unknown."""
    if any(not treedefs.get(v.state) for v in values):
        return ""
    return leaves_digest((v.state, treedefs[v.state], [codec.from_tensor(t) for t in v.leaves]) for v in values)
