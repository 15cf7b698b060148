"""Running a loaded job's instances: one device thread per slice.

:class:`SliceScheduler` runs each slice's instances one at a time, lowest step first,
then topological position, then microbatch; different slices run in parallel. An
instance ``(node, step, microbatch)`` runs once its step is granted (``until``), every
input is here (:class:`~rallypoint.workers.runtime.inputs.Inputs`), the slice's next
checkpoint does not hold it back, and the daemon's gate lets this incarnation act.
A slice starts no new instance while the job's pushes not yet ended hold more bytes
than its output log's limit (back-pressure from a slow consumer,
:class:`~rallypoint.workers.runtime.outbox.Outbox`). No file is written under the
job's lock: the instance record is written before the lock is taken, and the output
log spills after it is let go.
When a checkpoint is due the slice saves before anything later runs
(:class:`~rallypoint.workers.runtime.handoff.CheckpointHandoff`). A finished instance's
outputs go to the router, its state updates become new versions, and an
``InstanceDone`` (compute time, metrics, the loop's own work on it) goes to the job's
event stream. An instance that raises fails the job.

Outputs stay on the slice's devices (:mod:`rallypoint.workers.residency`): the loop
waits until an instance's outputs are computed (its compute time, and an error is
the instance's), then hands the arrays on as they are; only the metric scalars are
copied off, all of an instance's together.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping

from rallypoint.basics.errors import RallypointError
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.corruption import StateCorruption
from rallypoint.workers.runtime.records import InstanceRecords
from rallypoint.workers.residency import Copies, to_host
from rallypoint.workers.runtime.control import JobControl
from rallypoint.workers.runtime.handoff import CheckpointHandoff
from rallypoint.workers.runtime.inputs import Inputs
from rallypoint.workers.runtime.load import LoadedNode
from rallypoint.workers.runtime.routes import Router
from rallypoint.workers.runtime.state import Leaves, StateVersions, runs_at, running_steps


def _computed(leaves: Leaves) -> None:
    """Wait until every device array of ``leaves`` is computed (raises the computation's error)."""
    for x in leaves:
        wait = getattr(x, "block_until_ready", None)
        if wait is not None:
            wait()


class SliceScheduler:
    """The device threads of one job on this worker, and the count of instances they ran.

    Owns the threads (one per slice), each node's ``progress`` (which instances started),
    ``completed`` and ``expected`` (instances run, and to run from the start step to the end).

    Args:
        control: the job's control (the lock; ``until``, ``stopped``, ``error``; the gate; events).
        slice_nodes: each slice's nodes here, in topological order.
        inputs: where instances take their arguments.
        router: where their outputs go.
        handoff: the slices' checkpoints.
        records: where each instance run is recorded.
        states: the resident states (a state update adds a version).
        steps: the job's step count.
        start_step: the first step this runtime runs.
        copies: where the job's host-device copies are counted (None: not counted).
        corrupt: the worker's ``corrupt`` fault hook, given each state update before it is stored and sent
            (:mod:`rallypoint.workers.corruption`; None: off, always in production).
    """

    def __init__(self, control: JobControl, slice_nodes: Mapping[str, list[LoadedNode]], *, inputs: Inputs,
                 router: Router, handoff: CheckpointHandoff, records: InstanceRecords,
                 states: Mapping[str, StateVersions], steps: int, start_step: int,
                 copies: Copies | None = None, corrupt: StateCorruption | None = None) -> None:
        self._control = control
        self._corrupt = corrupt
        self._copies = copies
        self._slice_nodes = slice_nodes
        self._inputs = inputs
        self._router = router
        self._handoff = handoff
        self._records = records
        self._states = states
        self._steps = steps
        self.completed = 0
        self.idle_looks = dict.fromkeys(slice_nodes, 0)  # slice -> times its thread looked and found nothing to run
        self.expected = sum((running_steps(steps, n.prog.every) - running_steps(start_step, n.prog.every)) * len(n.mbs)
                            for nodes in slice_nodes.values() for n in nodes)
        self._threads = [
            threading.Thread(target=self._slice_loop, args=(s,), name=f"run-{control.job}-{s}", daemon=True)
            for s in slice_nodes
        ]

    @property
    def finished(self) -> bool:
        """Whether every instance of this worker has run (under the lock)."""
        return self.completed >= self.expected

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def alive(self) -> bool:
        """Whether any of the device threads still runs."""
        return any(t.is_alive() for t in self._threads)

    def join(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s`` in all) for the device threads to end, once the job stopped."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(max(deadline - time.monotonic(), 0.0))

    def _slice_loop(self, slice_name: str) -> None:
        control, cv = self._control, self._control.cv
        nodes = self._slice_nodes[slice_name]
        while True:
            cut: dict[str, Leaves | None] | None = None
            with cv:
                while True:
                    picked = time.perf_counter()  # the loop's work on an instance starts with finding it
                    if control.stopped or control.error:
                        return
                    due = self._handoff.due(slice_name, min((n.progress.low for n in nodes), default=self._steps))
                    if due is not None and nodes and not self._may_act(nodes[0], due, -1):
                        self.idle_looks[slice_name] += 1
                        cv.wait(0.1)  # fenced: a save now could replace the checkpoint of the slice's new owner
                        continue
                    if due is not None:
                        cut = self._handoff.snapshot(slice_name, due)
                        break
                    if self._router.backlogged:  # back-pressure: a consumer is not taking what was sent
                        cv.wait(1.0)
                        continue
                    found = self._next_ready(nodes, self._handoff.barrier(slice_name))
                    if found is not None and self._may_act(*found):
                        break
                    self.idle_looks[slice_name] += 1  # nothing ready, or not allowed to act (fenced)
                    cv.wait(1.0 if found is None else 0.1)
                if cut is None:
                    node, step, mb = found
                    node.progress.mark_started(step, mb)
                    try:
                        args = self._inputs.take(node, step, mb)
                    except Exception as exc:  # a bookkeeping bug: fail the job loudly, not hang
                        control.fail_instance(node.prog.name, step, mb, 0.0,
                                              f"gathering inputs: {type(exc).__name__}: {exc}", exc)
                        return
            if cut is not None:
                assert due is not None
                self._handoff.save(slice_name, due, cut)
                continue
            t0 = time.perf_counter()
            try:
                leaves = list(node.call(*args))
                want = sum(o.leaves for o in node.prog.outputs)
                if len(leaves) != want:
                    raise ValueError(f"the program returned {len(leaves)} leaves, its outputs declare {want}")
                _computed(leaves)  # on the devices, done: its compute time, and its error is the instance's
                metrics = self._metrics(node, leaves)
            except Exception as exc:  # user code or XLA: the job fails with it
                with cv:
                    control.fail_instance(node.prog.name, step, mb, time.perf_counter() - t0,
                                          f"{type(exc).__name__}: {exc}", exc)
                return
            compute_s = time.perf_counter() - t0
            del args
            self._records.ran(node.prog.name, step, mb, compute_s)  # a file write: outside the lock
            with cv:
                if control.stopped:
                    return
                try:
                    self._complete(node, step, mb, leaves, compute_s, picked, metrics)
                except Exception as exc:  # a routing bug: fail the job loudly, not hang
                    control.fail_instance(node.prog.name, step, mb, compute_s,
                                          f"delivering outputs: {type(exc).__name__}: {exc}", exc)
                    return
                cv.notify_all()
            self._router.relieve()  # the output log's spills write files: outside the lock

    def _next_ready(self, nodes: list[LoadedNode],
                    barrier: float = math.inf) -> tuple[LoadedNode, int, int] | None:
        """The first instance of the slice, in (step, position, microbatch) order, that may run."""
        if not nodes:
            return None
        for step in range(min(n.progress.low for n in nodes), int(min(self._control.until, self._steps, barrier))):
            for n in nodes:
                if not runs_at(step, n.prog.every):
                    continue
                for mb in n.mbs:
                    if not n.progress.is_started(step, mb) and self._inputs.ready(n, step, mb):
                        return n, step, mb
        return None

    def _may_act(self, node: LoadedNode, step: int, mb: int) -> bool:
        """The daemon's fence, checked before each instance; an ended incarnation ends the job."""
        control = self._control
        try:
            control.admit()
            return True
        except RallypointError as exc:
            if control.incarnation_ended():
                control.fail_instance(node.prog.name, step, mb, 0.0,
                                      f"incarnation {control.incarnation} of worker {control.worker_id} ended: {exc}")
            return False

    def _metrics(self, n: LoadedNode, leaves: Leaves) -> dict[str, float]:
        """The instance's metric scalars, copied off the device together (``metric``)."""
        wanted: list[tuple[str, int]] = []
        i = 0
        for out in n.prog.outputs:
            wanted += [(metric, i) for metric in out.metrics]
            i += out.leaves
        if not wanted:
            return {}
        host = to_host([leaves[i] for _, i in wanted], self._copies, "metric")
        return {metric: float(x) for (metric, _), x in zip(wanted, host, strict=True)}

    def _complete(self, n: LoadedNode, step: int, mb: int, leaves: Leaves, compute_s: float, picked: float,
                  metrics: Mapping[str, float]) -> None:
        self.completed += 1
        done = pb.InstanceDone(node=n.prog.name, step=step, microbatch=mb, compute_s=compute_s,
                               saving_s=self._handoff.take_saving_s(n.prog.slice))
        if (first := n.call.first_report()) is not None:  # where the executable came from, and its compile time
            done.program_source, done.compile_s = first
        i = 0
        new_state = False
        for out in n.prog.outputs:
            value, i = leaves[i : i + out.leaves], i + out.leaves
            if out.updates_state and self._corrupt is not None:  # fault injection: silent data corruption
                value = self._corrupt(self._control.job, n.prog.slice, n.prog.name, step, value)
            for metric in out.metrics:
                done.metrics[metric] = metrics[metric]
            self._router.send_output(n.prog.name, out.name, step, mb, value)
            if out.updates_state:
                self._states[out.updates_state].add(step + 1, value)
                new_state = True
        if new_state:
            self._router.pump_state_pushes()
        done.busy_s = max(0.0, time.perf_counter() - picked - compute_s)
        self._control.publish(done)
