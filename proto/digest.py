"""The state digest over flat leaves as they travel on the wire.

``sha256`` over every state in name order: the name and its pytree structure (node types
by name, static fields by value, no object addresses: :func:`structure`), then each leaf's
dtype, shape and bytes. :func:`rallypoint.client.reference.state_digest`
computes the same from the pytrees, so the coordinator can report the digest of a
job whose client holds no program (``rallypoint resume``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

import numpy as np

from rallypoint.proto import codec
from rallypoint.proto import rallypoint_pb2 as pb


def structure(treedef: Any) -> str:
    """A pytree structure (a JAX ``PyTreeDef``) as text that is the same in every process.

    ``str(treedef)`` prints a custom node's static fields by ``repr``, and a static function or
    object (a Flax ``TrainState``'s ``apply_fn`` and ``tx``) prints with its memory address, which
    changes from one process to the next. Here each node is its type by qualified name,
    its static data with plain values kept (dict keys, field names, numbers, strings) and any other
    object named by its type (a function by its qualified name), then its children in order.
    """
    node = treedef.node_data()
    if node is None:
        return "*"
    kind, aux = node
    inner = ",".join(structure(child) for child in treedef.children())
    return f"{_name(kind)}[{_static(aux)}]({inner})"


def _name(obj: Any) -> str:
    """A type or function by its qualified name, not its module: a job file's own classes and functions live in
    ``__main__`` in one process and in a module named after the file in another."""
    return getattr(obj, "__qualname__", type(obj).__qualname__)


def _static(value: Any) -> str:
    """Static pytree data as text without addresses (see :func:`structure`)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, Enum):
        return f"{_name(type(value))}.{value.name}"
    if isinstance(value, (tuple, list)):
        items = ",".join(_static(v) for v in value)
        return f"{_name(type(value))}({items})" if type(value) not in (tuple, list) else f"[{items}]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_static(k)}:{_static(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(_static(v) for v in value)) + "}"
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return _name(value)  # a class or a function: its name, never its address
    return f"<{_name(type(value))}>"


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


RESHARD_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
"""How close a run whose slices changed device count ends to the fault-free reference.

On another device count XLA splits and reduces the same sums in another order, so
float32 results differ in their last bits from step to step; these bounds hold for
the examples over their runs (docs/recovery.md, "Another device count"). A run that
never changed device counts is compared bitwise (the digest), never with these.
"""


def states_close(got: Mapping[str, Sequence[Any]], want: Mapping[str, Sequence[Any]], *,
                 rtol: float, atol: float) -> tuple[bool, str]:
    """Whether every leaf of ``got`` is within ``atol + rtol * |want|`` of ``want``; and the evidence.

    Both map a state name to its flat leaves. Integer leaves (step counters) must be equal.
    """
    if set(got) != set(want):
        return False, f"states {sorted(got)} != {sorted(want)}"
    worst, where = 0.0, ""
    for name in sorted(want):
        if len(got[name]) != len(want[name]):
            return False, f"state {name!r}: {len(got[name])} leaves, expected {len(want[name])}"
        for i, (g, w) in enumerate(zip(got[name], want[name], strict=True)):
            g, w = np.asarray(g), np.asarray(w)
            if g.shape != w.shape or g.dtype != w.dtype:
                return False, f"state {name!r} leaf {i}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}"
            if not np.issubdtype(w.dtype, np.floating):
                if not np.array_equal(g, w):
                    return False, f"state {name!r} leaf {i}: integer values differ"
                continue
            excess = np.abs(g.astype(np.float64) - w) - (atol + rtol * np.abs(w.astype(np.float64)))
            if excess.size and float(excess.max()) > 0:
                return False, (f"state {name!r} leaf {i}: off by up to {float(np.abs(g - w).max()):.3g} "
                               f"(rtol {rtol:g}, atol {atol:g})")
            err = float(np.abs(g.astype(np.float64) - w).max()) if g.size else 0.0
            if err >= worst:
                worst, where = err, f"{name}[{i}]"
    return True, f"every leaf within rtol {rtol:g} / atol {atol:g}; largest difference {worst:.3g} ({where})"
