"""Where a loaded job's values live on a worker, and every copy between host and device.

Values stay on the slice's devices (DESIGN.md, the flow of a job, 4): a state's
versions, a node's outputs and the values delivered to a consumer are ``jax.Array``s
on the consuming slice's devices, with the sharding its exported program takes. A
value leaves the device only for a reason, and each copy is counted by direction
(``d2h``, ``h2d``) and purpose (:data:`PURPOSES`) in :class:`Copies`, one per loaded
job, which also feeds the worker's metrics (``rallypoint_worker_copy_bytes``):

* ``transfer``: a value pushed to another worker leaves once (one host copy shared by
  every push and the output log, :class:`HostCopy`), on the push thread, so the copy
  overlaps the slice's next instance; a value pushed here goes onto the consumer's
  devices once, on the receiving thread, before the job's lock is taken;
* ``checkpoint``: a slice's states copied off for Orbax (the step waits for that copy
  only), or back on at a restore;
* ``log_spill``: a logged value written to disk before its push made a host copy;
* ``metric``: an instance's metric scalars, fetched together;
* ``fetch``: the final states the coordinator asks for;
* ``step``: the step and microbatch numbers a source or node takes (4 bytes each);
* ``source``: a host source's batch, put on the slice's devices as it arrives from the
  source's process, ahead of the instance that hands it on (docs/data.md).

Moving a value between two slices of one worker is a device-to-device copy
(``jax.device_put``) and not counted: no host memory is touched.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from rallypoint.workers import meter

PURPOSES = ("transfer", "checkpoint", "log_spill", "metric", "fetch", "step", "source")
DIRECTIONS = ("d2h", "h2d")


def is_device_array(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` (a value on devices), not a host array."""
    import jax

    return isinstance(x, jax.Array)


class Copies:
    """Bytes one job copied between host and device on this worker, by direction and purpose.

    Thread-safe; each :meth:`add` also goes to the process's meter (when one is installed).
    """

    def __init__(self, job: str) -> None:
        self.job = job
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], int] = {}
        self._count: dict[tuple[str, str], int] = {}

    def add(self, direction: str, purpose: str, n: int) -> None:
        if direction not in DIRECTIONS or purpose not in PURPOSES:
            raise ValueError(f"unknown copy {direction}/{purpose}")
        with self._lock:
            self._bytes[(direction, purpose)] = self._bytes.get((direction, purpose), 0) + n
            self._count[(direction, purpose)] = self._count.get((direction, purpose), 0) + 1
        meter.copied(self.job, direction, purpose, n)

    def bytes(self, direction: str, purpose: str | None = None) -> int:
        """Bytes copied in ``direction`` for ``purpose`` (None: all purposes)."""
        with self._lock:
            return sum(n for (d, p), n in self._bytes.items() if d == direction and purpose in (None, p))

    def count(self, direction: str, purpose: str | None = None) -> int:
        """How many values (or leaf batches) were copied in ``direction`` for ``purpose`` (None: all)."""
        with self._lock:
            return sum(n for (d, p), n in self._count.items() if d == direction and purpose in (None, p))

    def snapshot(self) -> dict[str, int]:
        """``{"d2h/transfer": bytes, ...}`` for every copy made so far."""
        with self._lock:
            return {f"{d}/{p}": n for (d, p), n in sorted(self._bytes.items())}


def to_host(leaves: Sequence[Any], copies: Copies | None, purpose: str) -> list[np.ndarray]:
    """``leaves`` as host arrays; the device ones are copied (all started at once, then waited for)."""
    on_device = [x for x in leaves if is_device_array(x)]
    for x in on_device:
        try:
            x.copy_to_host_async()
        except Exception:  # noqa: BLE001 - only a head start: np.asarray below copies it anyway
            pass
    out = [np.asarray(x) for x in leaves]
    if on_device and copies is not None:
        copies.add("d2h", purpose, meter.payload_bytes(on_device))
    return out


SMALL_VALUE_BYTES = 256 << 10
"""A host value smaller than this is handed to the call as it is: XLA's dispatch copies it
onto the devices in C++ within the call (microseconds), where an explicit ``jax.device_put``
costs 40-80 us of Python; above it, the value is put on the devices once and kept there."""


_SAME: dict[tuple[Any, Any, int], bool] = {}
_SAME_MAX = 4096


def same_layout(have: Any, want: Any, ndim: int) -> bool:
    """Whether an array of ``ndim`` dimensions laid out as ``have`` is laid out as ``want``.

    ``Sharding.is_equivalent_to`` costs microseconds, and a step's arguments ask it of
    every leaf at every call: the answers are kept (shardings are immutable and hashable;
    a program's output shardings are the same objects at every call)."""
    if have is want:
        return True
    key = (have, want, ndim)
    got = _SAME.get(key)
    if got is None:
        if len(_SAME) >= _SAME_MAX:
            _SAME.clear()
        got = _SAME[key] = bool(have.is_equivalent_to(want, ndim))
    return got


def place(leaves: Sequence[Any], shardings: Sequence[Any], copies: Copies | None, purpose: str, *,
          small: str = "") -> list[Any]:
    """``leaves`` on the devices of ``shardings`` (one per leaf), each as that sharding lays it out.

    A device array already laid out so stays as it is; one on other devices or laid out
    otherwise is moved device to device; a host array is copied on (counted as
    ``purpose``). All moves go in one ``jax.device_put``.

    ``small``: what becomes of a host leaf under :data:`SMALL_VALUE_BYTES`: ``""`` (put on the
    devices like any other), ``"later"`` (left on the host and not counted: a value received
    here, placed when an instance takes it) or ``"call"`` (left on the host for the call to
    copy on, and counted now: an instance's arguments).
    """
    if shardings and hasattr(shardings[0], "place_leaf"):  # a multi-host slice's layouts (workers/gang/lead.py)
        return [s.place_leaf(x, copies, purpose, small) for x, s in zip(leaves, shardings, strict=True)]
    import jax

    out = list(leaves)
    todo: list[int] = []
    host = 0
    for i, (x, s) in enumerate(zip(leaves, shardings, strict=True)):
        if is_device_array(x):
            if same_layout(x.sharding, s, x.ndim):
                continue
        else:
            n = int(np.asarray(x).nbytes)
            host += n if small != "later" or n >= SMALL_VALUE_BYTES else 0
            if small and n < SMALL_VALUE_BYTES:
                continue
        todo.append(i)
    if todo:
        moved = jax.device_put([leaves[i] for i in todo], [shardings[i] for i in todo])
        for i, x in zip(todo, moved, strict=True):
            out[i] = x
    if host and copies is not None:
        copies.add("h2d", purpose, host)
    return out


def replicated(mesh: Any) -> Any:
    """The sharding that puts a whole value on every device of ``mesh``."""
    import jax

    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def unstacked(sharding: Any, mesh: Any) -> Any:
    """The sharding of one part of a value stacked on a new axis 0 laid out as ``sharding``."""
    if hasattr(sharding, "unstacked"):  # a multi-host slice's layout (workers/gang/lead.py)
        return sharding.unstacked()
    import jax

    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:]))
    return replicated(mesh)


class HostCopy:
    """One value's host copy, made once (by whichever push or spill needs it first) and shared.

    The pushes of one output to several workers and the output log keeping it for a
    resend all hold the same :class:`HostCopy`: the value leaves the device at most once,
    and once it has, the device buffers are no longer held here.
    """

    def __init__(self, leaves: Sequence[Any], copies: Copies | None) -> None:
        self._leaves: list[Any] | None = list(leaves)
        self._host: list[np.ndarray] | None = None
        self._copies = copies
        self._lock = threading.Lock()
        self.nbytes = meter.payload_bytes(leaves)
        self.count = len(self._leaves)
        self.on_device = any(is_device_array(x) for x in leaves)

    @property
    def ready(self) -> bool:
        """Whether the host copy exists (the device buffers are let go)."""
        return self._host is not None

    def leaves(self) -> list[Any]:
        """The value where it is now: the device arrays until the host copy is made, then the host arrays."""
        with self._lock:
            return list(self._host if self._host is not None else self._leaves or [])

    def get(self, purpose: str = "transfer") -> list[np.ndarray]:
        """The host arrays; the first call copies them off the device, counted as ``purpose``."""
        with self._lock:
            if self._host is None:
                assert self._leaves is not None
                self._host = to_host(self._leaves, self._copies, purpose)
                self._leaves = None
                self.on_device = False
            return self._host


def host_copy(value: Sequence[Any] | HostCopy, copies: Copies | None) -> HostCopy:
    """``value`` as a :class:`HostCopy` (a list of leaves is wrapped; nothing is copied yet)."""
    return value if isinstance(value, HostCopy) else HostCopy(value, copies)
