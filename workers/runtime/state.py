"""Bookkeeping of one job on a worker: which instances ran, what has arrived, which
state versions are kept.

Plain data structures with no threads and no gRPC: the pieces of
:class:`rallypoint.workers.runtime.runtime.JobRuntime` use them under the job's lock (each
node's :class:`NodeProgress` is the scheduler's, the :class:`Inbox` belongs to the
inputs, the :class:`StateVersions` are shared: see :mod:`rallypoint.workers.runtime.runtime`).
Kept apart so the rules (state versions, idempotent delivery, when a value may be
dropped) are small and tested on their own. The runtime's errors are in :mod:`rallypoint.workers.errors`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rallypoint.workers.residency import Copies, HostCopy


Leaves = list[Any]
"""One value as its flat leaves: ``jax.Array``s on the slice's devices, or host numpy arrays
(a value that arrived from another worker and is not placed yet, or one read back from disk)."""

Key = tuple[str, str, int, int]
"""Where a delivered value goes: (consumer node, input arg, step, microbatch; -1: per step)."""


def runs_at(step: int, every: int) -> bool:
    """Whether a node running every ``every`` steps runs at ``step``."""
    return step % max(every, 1) == 0


def running_steps(steps: int, every: int) -> int:
    """How many of the steps ``0 .. steps-1`` a node running every ``every`` steps runs at."""
    e = max(every, 1)
    return (steps + e - 1) // e


class NodeProgress:
    """Which instances of one node have started: a watermark plus the instances above it.

    Memory stays bounded by the instances in flight, however long the job runs.
    """

    def __init__(self, every: int, microbatches: Sequence[int], steps: int, start: int = 0) -> None:
        self.every = max(every, 1)
        self.microbatches = tuple(microbatches)
        self.steps = steps
        # every instance of every running step below ``low`` has started (or, below
        # ``start``, is not this runtime's: it resumed from a checkpoint at ``start``)
        self.low = -(-start // self.every) * self.every
        self._partial: dict[int, set[int]] = {}

    def is_started(self, step: int, mb: int) -> bool:
        return step < self.low or mb in self._partial.get(step, ())

    def mark_started(self, step: int, mb: int) -> None:
        self._partial.setdefault(step, set()).add(mb)
        while len(self._partial.get(self.low, ())) == len(self.microbatches):
            del self._partial[self.low]
            self.low += self.every

    @property
    def all_started(self) -> bool:
        return self.low >= self.steps


class StateVersions:
    """The versions of one resident state that something may still read or push.

    Version ``v`` is the value read at steps ``v, v+1, ...`` until the next version:
    ``0`` is the init; a producer running every ``k`` steps makes version ``t + 1`` at
    step ``t`` (so step ``s`` reads the output of the last producer run before ``s``).
    A version is dropped once it is not the newest and its uses are spent: each read
    by a local instance and each push to a remote consumer, over the steps it serves.

    Args:
        name: the state.
        producer_every: the producer's ``every``; 0 when nothing produces the state.
        steps: the job's step count.
        readers: per local reading input, ``(every, instances per running step)``.
        push_everies: per remote consumer it is pushed to, that consumer's ``every``
            (it is pushed the steps the consumer runs at).
        start: the first step this runtime runs (a restored checkpoint's step); the
            first version added is the one step ``start`` reads.

    A version can be **pinned** (:meth:`pin`): it is kept until the pin moves, so the
    checkpoint of a step can read it even after its uses are spent.
    """

    def __init__(self, name: str, producer_every: int, steps: int, readers: Sequence[tuple[int, int]],
                 push_everies: Sequence[int], start: int = 0) -> None:
        self.name = name
        self.k = max(producer_every, 0)
        self.steps = steps
        self.start = start
        self.pinned: int | None = None
        self.readers = list(readers)
        self.push_everies = list(push_everies)
        self._values: dict[int, Leaves] = {}
        self._uses: dict[int, int] = {}
        self._host: dict[int, HostCopy] = {}  # version -> its one host copy, made for pushes to other workers
        self.newest = -1

    def key(self, step: int) -> int:
        """The version step ``step`` reads."""
        if not self.k or step <= 0:
            return 0
        return ((step - 1) // self.k) * self.k + 1

    def _served_steps(self, version: int) -> range:
        if version == 0:
            return range(self.start, min(1, self.steps))
        return range(max(version, self.start), min(version + self.k, self.steps))

    def pin(self, step: int) -> None:
        """Keep the version step ``step`` reads (and let the previous pin go)."""
        self.pinned = self.key(step)
        self._collect()

    def add(self, version: int, leaves: Leaves) -> None:
        """A new version arrived (the init, or a producer's output)."""
        self._values[version] = leaves
        if self.k:
            self._uses[version] = sum(
                sum(n for every, n in self.readers if runs_at(s, every))
                + sum(1 for every in self.push_everies if runs_at(s, every))
                for s in self._served_steps(version)
            )
        self.newest = max(self.newest, version)
        self._collect()

    def at(self, step: int) -> Leaves | None:
        """The value step ``step`` reads, or None when it is not produced yet."""
        return self._values.get(self.key(step))

    def use(self, step: int) -> Leaves:
        """Take the value of step ``step`` for one read or push (counts against its uses)."""
        v = self.key(step)
        leaves = self._values[v]
        if v in self._uses:
            self._uses[v] -= 1
            self._collect()
        return leaves

    def host_copy(self, step: int, copies: Copies | None) -> HostCopy:
        """The value step ``step`` reads, as the one host copy every push of that version shares."""
        v = self.key(step)
        hc = self._host.get(v)
        if hc is None:
            hc = self._host[v] = HostCopy(self._values[v], copies)
        return hc

    def _collect(self) -> None:
        for v in [v for v, n in self._uses.items() if n <= 0 and v != self.newest and v != self.pinned]:
            del self._uses[v]
            self._values.pop(v, None)
            self._host.pop(v, None)

    def __len__(self) -> int:
        return len(self._values)

    def clear(self) -> None:
        self._values.clear()
        self._uses.clear()
        self._host.clear()


class Inbox:
    """Delivered values waiting for their consumer instances, each with its remaining uses."""

    def __init__(self) -> None:
        self._values: dict[Key, list[Any]] = {}

    def __contains__(self, key: Key) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def put(self, key: Key, leaves: Leaves, uses: int) -> None:
        self._values[key] = [leaves, uses]

    def take(self, key: Key) -> Leaves:
        """The value for one consumer instance; dropped after its last use."""
        entry = self._values[key]
        entry[1] -= 1
        if entry[1] <= 0:
            del self._values[key]
        return entry[0]

    def clear(self) -> None:
        self._values.clear()
