"""What the instances of a loaded job read: values delivered to them, and resident states.

:class:`Inputs` receives every value meant for a consumer on this worker, whether
pushed by a peer (``Push``, the data plane) or handed over in memory by this
worker's own router, checks it against the consumer's input bindings and keeps it in
the :class:`~rallypoint.workers.runtime.state.Inbox` until the consumer instance takes
it. Delivery is idempotent per ``(consumer, arg, step, microbatch)``: a value already
held, or one whose instance has started, is a duplicate. Resident states are read in
place: step ``s`` reads the version its producer made before ``s`` (the init before that).

Values are kept on the consumer's devices (:mod:`rallypoint.workers.residency`): one
pushed from another worker is put there once, on the receiving thread, before the
job's lock is taken (:meth:`Inputs.placed`); one handed over from another slice of this
worker moves device to device; the arguments of an instance are laid out as the
node's exported program takes them. A small host value (under
``residency.SMALL_VALUE_BYTES``: the step numbers, a small pushed value) is left for the
call to copy on, which XLA's dispatch does faster than an explicit ``jax.device_put``.

A source's step argument is the stream position the step reads: the step itself, unless the run
skips batches (``LoadJobRequest.skips``, :mod:`rallypoint.recovery.skips`); a clock source
(``NodeProgram.clock``) always gets the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.skips import Skips
from rallypoint.workers.residency import Copies, is_device_array, place, unstacked
from rallypoint.workers.runtime.control import JobControl
from rallypoint.workers.runtime.load import LoadedNode
from rallypoint.workers.errors import DeliveryError
from rallypoint.workers.runtime.state import Inbox, Key, Leaves, StateVersions, runs_at

B = pb.InputBinding


class Inputs:
    """Delivered values waiting for their instances (owns the inbox); all under the job's lock.

    Args:
        control: the job's control (``stopped``; names in errors).
        nodes: the job's nodes here (read: their bindings and progress).
        states: the job's resident states (read in place; each read counts against the version's uses).
        steps: the job's step count.
        microbatches: microbatches per step.
        copies: where the job's host-device copies are counted (None: not counted).
        skips: the stream positions the run skips (a source's step argument is the position its step reads).
    """

    def __init__(self, control: JobControl, nodes: Mapping[str, LoadedNode], states: Mapping[str, StateVersions], *,
                 steps: int, microbatches: int, copies: Copies | None = None, skips: Skips = Skips()) -> None:
        self._control = control
        self._nodes = nodes
        self._states = states
        self._steps = steps
        self._m = microbatches
        self._copies = copies
        self._skips = skips
        self._inbox = Inbox()
        self._layout: dict[tuple[str, str], tuple[list[Any], list[Any]]] = {}  # (node, arg) -> (whole, delivered)

    def _shardings(self, n: LoadedNode, arg: str) -> tuple[list[Any], list[Any]] | None:
        """How input ``arg`` of ``n`` is laid out: as the call takes it, and as one delivered value of it
        (a gathered input arrives one microbatch at a time); None when the program does not say."""
        key = (n.prog.name, arg)
        if key not in self._layout:
            shardings = getattr(n.call, "in_shardings", None)
            if shardings is None:
                return None
            i = 0
            for b in n.prog.inputs:
                whole = list(shardings[i : i + b.leaves])
                i += b.leaves
                delivered = [unstacked(s, n.call.mesh) for s in whole] if b.kind == B.GATHER else whole
                self._layout[(n.prog.name, b.arg)] = (whole, delivered)
        return self._layout.get(key)

    def placed(self, header: pb.TransferHeader, leaves: Leaves) -> Leaves:
        """``leaves`` of a value pushed here, on its consumer's devices (counted: ``transfer``).

        Called before the job's lock is taken; a value that matches no input comes back
        as it is (:meth:`deliver` refuses it).
        """
        n = self._nodes.get(header.consumer_node)
        layout = self._shardings(n, header.arg) if n is not None else None
        if layout is None or len(layout[1]) != len(leaves):
            return leaves
        return place(leaves, layout[1], self._copies, "transfer", small="later")

    def deliver(self, header: pb.TransferHeader, leaves: Leaves) -> bool:
        """Keep a value for its consumer instance(s); returns True for a duplicate (dropped). Under the lock.

        Raises:
            DeliveryError: the value matches no input of the job here.
        """
        control = self._control
        if control.stopped:
            return False
        job = control.job
        n = self._nodes.get(header.consumer_node)
        if n is None:
            raise DeliveryError(f"job {job!r}: node {header.consumer_node!r} is not loaded on worker "
                                f"{control.worker_id}")
        b = next((b for b in n.prog.inputs if b.arg == header.arg), None)
        if b is None or b.kind in (B.STEP, B.MICROBATCH) or (b.kind == B.STATE and b.state in self._states):
            raise DeliveryError(f"job {job!r}: node {n.prog.name!r} takes no pushed input {header.arg!r}")
        step, mb = int(header.step), int(header.microbatch)
        per_mb_value = b.kind == B.GATHER or (b.kind == B.REF and b.producer_per_microbatch)
        if not 0 <= step < self._steps or not (0 <= mb < self._m if per_mb_value else mb == -1):
            raise DeliveryError(f"job {job!r}: {n.prog.name}.{header.arg} has no step {step} microbatch {mb}")
        if len(leaves) != b.leaves:
            raise DeliveryError(f"job {job!r}: {n.prog.name}.{header.arg} takes {b.leaves} leaves, got {len(leaves)}")
        if not runs_at(step, n.prog.every):
            return False  # the consumer does not run at this step: nothing needs it
        key: Key = (n.prog.name, header.arg, step, mb)
        consumer_mb = (mb if mb >= 0 else 0) if n.prog.per_microbatch else -1
        if key in self._inbox or n.progress.is_started(step, consumer_mb):
            return True
        self._inbox.put(key, leaves, self._m if n.prog.per_microbatch and mb < 0 else 1)
        return False

    @staticmethod
    def _arrival_mb(b: pb.InputBinding, mb: int) -> int:
        return mb if b.kind == B.REF and b.producer_per_microbatch else -1

    def ready(self, n: LoadedNode, step: int, mb: int) -> bool:
        """Whether every input of instance ``(n, step, mb)`` is here."""
        name = n.prog.name
        for b in n.prog.inputs:
            if b.kind in (B.STEP, B.MICROBATCH):
                continue
            if b.kind == B.STATE and b.state in self._states:
                if self._states[b.state].at(step) is None:
                    return False
            elif b.kind == B.GATHER:
                if any((name, b.arg, step, i) not in self._inbox for i in range(self._m)):
                    return False
            elif (name, b.arg, step, self._arrival_mb(b, mb)) not in self._inbox:
                return False
        return True

    def take(self, n: LoadedNode, step: int, mb: int) -> list[Any]:
        """The arguments of a ready instance, in binding order; each value taken counts against its uses.

        A gather stacks the step's microbatch values on a new axis 0 (on their devices).
        Every argument is laid out as the node's program takes it: a state read from
        another slice of this worker moves device to device; a small host value (the
        step and microbatch numbers, a value under ``SMALL_VALUE_BYTES`` received from
        another worker) is left for the call to copy on, and counted (``step``, ``transfer``).
        """
        name = n.prog.name
        args: list[Any] = []
        numbers: list[int] = []  # positions of the step and microbatch numbers
        for b in n.prog.inputs:
            if b.kind in (B.STEP, B.MICROBATCH):
                numbers.append(len(args))
                at = step if n.prog.clock or not self._skips else self._skips.position(step)
                args.append(np.int32(at if b.kind == B.STEP else (mb if mb >= 0 else 0)))
            elif b.kind == B.STATE and b.state in self._states:
                args += self._states[b.state].use(step)
            elif b.kind == B.GATHER:
                parts = [self._inbox.take((name, b.arg, step, i)) for i in range(self._m)]
                args += [_stack(xs) for xs in zip(*parts, strict=True)]
            else:
                args += self._inbox.take((name, b.arg, step, self._arrival_mb(b, mb)))
        shardings = getattr(n.call, "in_shardings", None)
        if shardings is None or len(shardings) != len(args):
            return args
        for purpose, idx in (("step", numbers), ("transfer", [i for i in range(len(args)) if i not in numbers])):
            if idx:
                for i, x in zip(idx, place([args[i] for i in idx], [shardings[i] for i in idx], self._copies,
                                           purpose, small="call"), strict=True):
                    args[i] = x
        return args

    def clear(self) -> None:
        """Drop every value held (the job was unloaded)."""
        self._inbox.clear()


def _stack(parts: tuple[Any, ...]) -> Any:
    """The microbatch values of one leaf stacked on a new axis 0: on their devices, or with numpy on the host."""
    if any(is_device_array(x) for x in parts):
        import jax.numpy as jnp

        return jnp.stack(parts)
    return np.stack(parts)
