"""The worker runtime: loaded jobs, one device thread per slice, worker-to-worker pushes.

The coordinator loads a job on each worker that holds one of its slices
(``LoadJob``: exported programs, state inits and a routing table), grants steps
(``RunSteps``), hears completions (``JobEvents``) and fetches the final state
(``FetchState``). Tensors never go through it: a worker runs an instance as soon as
its inputs have arrived and its step is granted, and pushes each output straight to
the consuming worker (over its data plane, :mod:`rallypoint.workers.dataplane`, or a gRPC
``Push``), or hands it over in memory when the consumer is its own. The gRPC and
data-plane front is :mod:`rallypoint.workers.runtime_service`. The semantics are those of
:class:`rallypoint.client.reference.ReferenceExecutor`, so a run ends in bitwise the same state:

* an instance is ``(node, step, microbatch)``; a node runs at steps divisible by its
  ``every``; microbatch is -1 for per-step nodes;
* a state read at step ``s`` is the value its producer made at the last step before
  ``s`` (the init before that); resident states are read in place, others arrive by
  push, once per step;
* a gather stacks the step's microbatch values on a new axis 0 with numpy;
* delivery is idempotent per ``(consumer, arg, step, microbatch)``.

Instances of one slice run one at a time, lowest step first, then topological
position, then microbatch; different slices run in parallel.

Recovery (docs/recovery.md): slices checkpoint at the job's checkpoint steps
(:mod:`rallypoint.workers.job_checkpoints`), pushed values stay in the output log (:mod:`rallypoint.workers.outlog`)
until the cut passes them, a runtime can start from a checkpoint (``start_step``), and
``rewire`` points routes at moved consumers and sends them their logged inputs again.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rallypoint.basics.errors import RallypointError
from rallypoint.basics.logs import get_logger
from rallypoint.proto import codec, rallypoint_pb2 as pb
from rallypoint.workers.job_checkpoints import NO_FAULTS, CommitFn, JobCheckpoints, WorkerFaults, restore_for_load
from rallypoint.workers.replicas import ReplicaTier
from rallypoint.workers.outlog import OutputLog
from rallypoint.workers.events import EventFeed
from rallypoint.workers.programs import load_exported, slice_mesh
from rallypoint.workers.records import InstanceRecords
from rallypoint.workers.runtime_state import (DeliveryError, Inbox, Key, Leaves, LoadError, NodeProgress, RestoreError,
                                   StateVersions, runs_at, running_steps)
from rallypoint.workers.transfer import NotAllowed, PeerChannels, PushPools
from rallypoint.workers.warm import NodeExecutable, WarmCache, program_key

B = pb.InputBinding
Admit = Callable[[pb.Identity], object]

DEFAULT_LOG_LIMIT = 256 << 20  # output log bytes in memory when the request names none


@dataclass
class _Node:
    prog: pb.NodeProgram  # without its exported bytes
    call: NodeExecutable
    mbs: tuple[int, ...]
    progress: NodeProgress
    routes: dict[str, list[pb.Route]] = field(default_factory=dict)


@dataclass
class _StateRoute:
    route: pb.Route
    next_step: int = 0


class JobRuntime:
    """One job loaded on this worker: its programs, inputs, resident states and threads.

    Args:
        req: what to load.
        worker_id: this worker.
        devices: this worker's local devices (``SliceAssignment.devices`` index them).
        admit: the daemon's gate; raises when the worker may not act.
        incarnation: this worker's current incarnation.
        peers: the channels outputs are pushed on to other workers.
        push_threads: threads pushing outputs to other workers.
        commit_factory: makes this incarnation's checkpoint commit (None: no checkpoints).
        faults: test fault hooks of the job's checkpoints (:mod:`rallypoint.workers.faults`).
        replicas: the worker's in-memory checkpoint tier (:mod:`rallypoint.workers.replicas`; None: disk only).
        warm: executables compiled ahead for this worker (:mod:`rallypoint.workers.warm`; None: compile at first calls).
    """

    def __init__(self, req: pb.LoadJobRequest, *, worker_id: str, devices: Sequence[Any], admit: Admit,
                 incarnation: Callable[[], int], peers: PeerChannels, push_threads: int = 4,
                 commit_factory: Callable[[], CommitFn] | None = None, faults: WorkerFaults = NO_FAULTS,
                 replicas: ReplicaTier | None = None, warm: WarmCache | None = None) -> None:
        t0 = time.perf_counter()
        self._warm = warm
        self.program_sources: dict[str, str] = {}  # node -> "warm" (compiled ahead) or "cold" (at its first call)
        self.job = req.job
        self.steps = int(req.steps)
        self.start_step = int(req.start_step)
        self.m = max(int(req.microbatches), 1)
        self.worker_id = worker_id
        self.cluster = req.to.cluster
        self._admit = admit
        self._current_incarnation = incarnation
        self.incarnation = incarnation()
        self._peers = peers
        self.log = get_logger("rallypoint.runtime", job=self.job, worker=worker_id, incarnation=self.incarnation)
        self._cv = threading.Condition()
        self.until = 0
        self.stopped = False
        self.error = ""
        self._inbox = Inbox()
        self._events = EventFeed()
        self.completed = 0
        self._saving_s: dict[str, float] = {}  # slice -> its loop's blocking save time not yet reported (saving_s)
        self.outlog = OutputLog(int(req.log_limit_bytes) or DEFAULT_LOG_LIMIT)
        self.outlog.low = self.start_step  # a runtime started at a checkpoint made nothing before it
        self._pushes = PushPools(self.job, push_threads)
        self.restore_tiers: dict[str, str] = {}  # slice -> "memory" (a peer's copy) or "disk", when restored
        self._fetch = (lambda ref: replicas.fetch(req, ref, self.log)) if replicas is not None else None
        self._load(req, devices)
        start = self.start_step
        self.expected = sum((running_steps(self.steps, n.prog.every) - running_steps(start, n.prog.every)) * len(n.mbs)
                            for n in self.nodes.values())
        self.replicator = replicas.replicator(req, incarnation=self.incarnation, log=self.log) if replicas else None
        self.checkpoints = JobCheckpoints(req, commit_factory=commit_factory, on_commit=self._committed, faults=faults,
                                          log_fields={"worker": worker_id, "incarnation": self.incarnation},
                                          replicate=self.replicator.submit if self.replicator else None)
        self.records = InstanceRecords(self.checkpoints.root, worker=worker_id, incarnation=self.incarnation,
                                       slices=list(self._slice_nodes), start_step=start, job=self.job,
                                       restored_from=min((int(r.step) for r in req.restore), default=None))
        for name, sv in self.states.items():  # keep each state's value for its slice's next checkpoint
            sv.pin(int(min(self.checkpoints.barrier(self._state_slice[name]), self.steps)))
        self._threads = [
            threading.Thread(target=self._slice_loop, args=(s,), name=f"run-{self.job}-{s}", daemon=True)
            for s in self._slice_nodes
        ]
        self.load_s = time.perf_counter() - t0
        self.log.info("job.loaded", slices=list(self._slice_nodes), nodes=len(self.nodes), states=list(self.states),
                      steps=self.steps, start_step=start, load_s=round(self.load_s, 3))

    # -- loading -------------------------------------------------------------------------

    def _load(self, req: pb.LoadJobRequest, devices: Sequence[Any]) -> None:
        meshes: dict[str, Any] = {}
        for sa in req.slices:
            bad = [i for i in sa.devices if not 0 <= i < len(devices)]
            if bad or not sa.devices:
                raise LoadError(f"slice {sa.slice!r}: local device indices {list(sa.devices)} do not fit worker "
                                f"{self.worker_id}, which has {len(devices)} devices")
            try:
                meshes[sa.slice] = slice_mesh([devices[i] for i in sa.devices], sa.mesh_shape, sa.mesh_axes)
            except ValueError as exc:
                raise LoadError(f"slice {sa.slice!r}: {exc}") from exc

        def mesh_of(what: str, slice_name: str) -> Any:
            if slice_name not in meshes:
                raise LoadError(f"{what} is on slice {slice_name!r}, which is not assigned to worker {self.worker_id}")
            return meshes[slice_name]

        self.nodes: dict[str, _Node] = {}
        assigned = {sa.slice: sa for sa in req.slices}
        for n in req.nodes:  # topological order: the order instances of a step run in
            mesh = mesh_of(f"node {n.name!r}", n.slice)
            call = NodeExecutable(n.exported, mesh, self._warm.take(program_key(self.job, n, assigned[n.slice]))
                                  if self._warm is not None else None)
            self.program_sources[n.name] = call.expected
            prog = pb.NodeProgram()
            prog.CopyFrom(n)
            prog.ClearField("exported")
            mbs = tuple(range(self.m)) if n.per_microbatch else (-1,)
            self.nodes[n.name] = _Node(prog, call, mbs, NodeProgress(n.every, mbs, self.steps, self.start_step))
        self._slice_nodes = {sa.slice: [n for n in self.nodes.values() if n.prog.slice == sa.slice] for sa in req.slices}

        self._resident = {st.name for st in req.states}
        self._state_slice = {st.name: st.slice for st in req.states}
        self._state_routes: list[_StateRoute] = []
        self._set_routes(req.routes)

        restored = restore_for_load(req, self._fetch, self.restore_tiers) if self.start_step > 0 else {}
        self.states: dict[str, StateVersions] = {}
        for st in req.states:
            readers = [(n.prog.every, len(n.mbs)) for n in self.nodes.values() for b in n.prog.inputs
                       if b.kind == B.STATE and b.state == st.name]
            pushes = [sr.route.consumer_every for sr in self._state_routes if sr.route.state == st.name]
            sv = StateVersions(st.name, st.producer_every if st.producer_node else 0, self.steps, readers, pushes,
                               start=self.start_step)
            if self.start_step > 0:
                leaves = restored[st.slice].get(st.name)
                if leaves is None:
                    raise RestoreError(f"the checkpoint of slice {st.slice!r} at step {self.start_step} lacks "
                                       f"state {st.name!r}", slice_name=st.slice, step=self.start_step)
            else:
                init = load_exported(st.exported_init, mesh_of(f"state {st.name!r}", st.slice))
                leaves = [np.asarray(x) for x in init()]
            if len(leaves) != st.leaves:
                raise LoadError(f"state {st.name!r} has {len(leaves)} leaves, expected {st.leaves}")
            sv.add(sv.key(self.start_step), leaves)
            self.states[st.name] = sv

    def _set_routes(self, routes: Sequence[pb.Route]) -> None:
        """Install the routing table (at load, and again on ``rewire``); state pushes keep their progress."""
        progress = {(sr.route.state, sr.route.consumer_node, sr.route.arg): sr.next_step for sr in self._state_routes}
        for n in self.nodes.values():
            n.routes = {}
        state_routes: list[_StateRoute] = []
        for r in routes:
            if r.state:
                if r.state not in self._resident:
                    raise LoadError(f"route of state {r.state!r}, which is not resident on worker {self.worker_id}")
                if r.worker_id != self.worker_id:  # on this worker it is read in place
                    state_routes.append(_StateRoute(r, progress.get((r.state, r.consumer_node, r.arg),
                                                                    self.start_step)))
            elif r.node in self.nodes:
                self.nodes[r.node].routes.setdefault(r.output, []).append(r)
            else:
                raise LoadError(f"route from node {r.node!r}, which is not loaded on worker {self.worker_id}")
        self._state_routes = state_routes
        self._targets = {(r.worker_id, r.incarnation) for r in routes}
        self._pushes.keep_only(self._targets)

    def start(self) -> None:
        """Start the device threads; instances run once steps are granted."""
        for t in self._threads:
            t.start()

    # -- what the RPCs call -------------------------------------------------------------

    def grant(self, until_step: int, cut_step: int = 0, save_at: int = 0) -> None:
        """Let instances of steps below ``until_step`` run (never lowers the grant).

        ``cut_step``: the job's newest consistent cut; logged outputs and checkpoints
        older than it are no longer needed by any recovery. ``save_at`` (> 0, a drain):
        every slice also checkpoints at that step, off the schedule.
        """
        with self._cv:
            if save_at > 0:
                self.checkpoints.save_at(save_at)
            if until_step > self.until and not self.stopped:
                self.until = until_step
                self._pump_state_pushes()
                self._cv.notify_all()
        if cut_step > self.outlog.low:
            self.outlog.trim(cut_step)
            self.checkpoints.set_cut(cut_step)

    def rewire(self, routes: Sequence[pb.Route], resend_to: Sequence[str], from_step: int, until_step: int) -> int:
        """New routes after recovery moved consumers; send ``resend_to`` their logged inputs of steps ``>= from_step``.

        Pushes still retrying towards a worker no route names any more are dropped
        (the log holds their values). Returns how many values were sent again.

        Raises:
            LoadError: a route that does not fit this job here.
            DeliveryError: the log does not reach back to ``from_step``.
        """
        with self._cv:
            if from_step < self.outlog.low and resend_to:
                raise DeliveryError(f"job {self.job!r}: the output log of worker {self.worker_id} starts at step "
                                    f"{self.outlog.low}, after the step {from_step} asked for")
            self._set_routes(routes)
            resent = 0
            by_consumer: dict[tuple[str, str], list[pb.Route]] = {}
            for r in routes:
                by_consumer.setdefault((r.consumer_node, r.arg), []).append(r)
            for header, leaves in self.outlog.entries(resend_to, from_step):
                for r in by_consumer.get((header.consumer_node, header.arg), ()):
                    self._route(r, header, leaves)
                    resent += 1
            if until_step > self.until:
                self.until = until_step
            self._pump_state_pushes()
            self._cv.notify_all()
        self.log.info("job.rewired", resend_to=list(resend_to), from_step=from_step, resent=resent)
        return resent

    def deliver(self, header: pb.TransferHeader, leaves: Leaves) -> bool:
        """A value for a consumer on this worker; returns True for a duplicate (dropped).

        Raises:
            DeliveryError: the value matches no input of this job here.
        """
        with self._cv:
            duplicate = self._deliver_locked(header, leaves)
            self._cv.notify_all()
        return duplicate

    def subscribe(self) -> queue.Queue[pb.InstanceDone | None]:
        """A queue of this job's ``InstanceDone`` events (:class:`~rallypoint.workers.events.EventFeed`)."""
        return self._events.subscribe()

    def unsubscribe(self, q: queue.Queue[pb.InstanceDone | None]) -> None:
        self._events.unsubscribe(q)

    def wait_finished(self, timeout_s: float) -> bool:
        """Wait until every instance of this worker has run, the job failed or it was unloaded."""
        with self._cv:
            self._cv.wait_for(lambda: self.completed >= self.expected or bool(self.error) or self.stopped, timeout_s)
            return self.completed >= self.expected

    def final_states(self) -> list[pb.StateValue]:
        """Every resident state as it is at step ``steps`` (call once finished)."""
        with self._cv:
            return [pb.StateValue(state=name, leaves=[codec.to_tensor(a) for a in sv.at(self.steps) or []])
                    for name, sv in self.states.items()]

    def stop(self) -> None:
        """Stop the threads, end the event streams and drop every value. Idempotent."""
        with self._cv:
            if self.stopped:
                return
            self.stopped = True
            self._events.close()
            self._inbox.clear()
            for sv in self.states.values():
                sv.clear()
            self._cv.notify_all()
        self._pushes.shutdown()
        deadline = time.monotonic() + 5.0
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(max(deadline - time.monotonic(), 0.0))
        for part in (self.checkpoints, self.outlog, self.records, *([self.replicator] if self.replicator else [])):
            try:
                part.close()
            except Exception as exc:  # noqa: BLE001 - e.g. a save a fenced incarnation cannot finalize
                self.log.warning("job.close_failed", part=type(part).__name__, error=f"{type(exc).__name__}: {exc}")
        self.log.info("job.unloaded", completed=self.completed, expected=self.expected)

    # -- scheduling ----------------------------------------------------------------------

    def _slice_loop(self, slice_name: str) -> None:
        nodes = self._slice_nodes[slice_name]
        while True:
            cut: dict[str, Leaves | None] | None = None
            with self._cv:
                while True:
                    picked = time.perf_counter()  # the loop's work on an instance starts with finding it
                    if self.stopped or self.error:
                        return
                    due = self.checkpoints.due(slice_name, min((n.progress.low for n in nodes), default=self.steps))
                    if due is not None and nodes and not self._may_act(nodes[0], due, -1):
                        self._cv.wait(0.1)  # fenced: a save now could replace the checkpoint of the slice's new owner
                        continue
                    if due is not None:
                        cut = {name: sv.at(due) for name, sv in self.states.items()
                               if self._state_slice[name] == slice_name}
                        break
                    found = self._next_ready(nodes, self.checkpoints.barrier(slice_name))
                    if found is not None and self._may_act(*found):
                        break
                    self._cv.wait(1.0 if found is None else 0.1)
                if cut is None:
                    node, step, mb = found
                    node.progress.mark_started(step, mb)
                    try:
                        args = self._take_inputs(node, step, mb)
                    except Exception as exc:  # a bookkeeping bug: fail the job loudly, not hang
                        self._fail(node, step, mb, 0.0, f"gathering inputs: {type(exc).__name__}: {exc}")
                        return
            if cut is not None:
                assert due is not None
                t0 = time.perf_counter()
                self._checkpoint(slice_name, due, cut)
                self._saving_s[slice_name] = self._saving_s.get(slice_name, 0.0) + time.perf_counter() - t0
                continue
            t0 = time.perf_counter()
            try:
                leaves = [np.asarray(x) for x in node.call(*args)]
                want = sum(o.leaves for o in node.prog.outputs)
                if len(leaves) != want:
                    raise ValueError(f"the program returned {len(leaves)} leaves, its outputs declare {want}")
            except Exception as exc:  # user code or XLA: the job fails with it
                with self._cv:
                    self._fail(node, step, mb, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
                return
            compute_s = time.perf_counter() - t0
            del args
            with self._cv:
                if self.stopped:
                    return
                try:
                    self._complete(node, step, mb, leaves, compute_s, picked)
                except Exception as exc:  # a routing bug: fail the job loudly, not hang
                    self._fail(node, step, mb, compute_s, f"delivering outputs: {type(exc).__name__}: {exc}")
                    return
                self._cv.notify_all()

    def _checkpoint(self, slice_name: str, step: int, cut: dict[str, Leaves | None]) -> None:
        """Save the slice's states as at the start of ``step``.

        A save that fails (storage full or read-only, say) is skipped and logged: the
        cut stays where it was, recovery keeps using older checkpoints, and the next
        checkpoint step tries again.
        """
        missing = sorted(name for name, v in cut.items() if v is None)
        if missing:  # a bookkeeping bug: fail the job loudly
            with self._cv:
                self._fail_job(f"checkpoint of slice {slice_name!r} at step {step}: states {missing} have no value")
            return
        try:
            self.checkpoints.save(slice_name, step, {name: list(v or []) for name, v in cut.items()})
        except Exception as exc:  # noqa: BLE001 - training goes on; the checkpoint just does not count
            self.log.error("checkpoint.skipped", slice=slice_name, step=step, error=f"{type(exc).__name__}: {exc}")
        with self._cv:
            nxt = self.checkpoints.barrier(slice_name)
            for name, sv in self.states.items():
                if self._state_slice[name] == slice_name:
                    sv.pin(int(min(nxt, self.steps)))

    def _committed(self, slice_name: str, step: int) -> None:
        with self._cv:
            self._publish(pb.InstanceDone(checkpoint_slice=slice_name, checkpoint_step=step))

    def _next_ready(self, nodes: list[_Node], barrier: float = math.inf) -> tuple[_Node, int, int] | None:
        """The first instance of the slice, in (step, position, microbatch) order, that may run."""
        if not nodes:
            return None
        for step in range(min(n.progress.low for n in nodes), int(min(self.until, self.steps, barrier))):
            for n in nodes:
                if not runs_at(step, n.prog.every):
                    continue
                for mb in n.mbs:
                    if not n.progress.is_started(step, mb) and self._ready(n, step, mb):
                        return n, step, mb
        return None

    def _may_act(self, node: _Node, step: int, mb: int) -> bool:
        """The daemon's fence, checked before each instance; an ended incarnation ends the job."""
        try:
            self._admit(pb.Identity(cluster=self.cluster, worker_id=self.worker_id, incarnation=self.incarnation))
            return True
        except RallypointError as exc:
            if self._current_incarnation() != self.incarnation:
                self._fail(node, step, mb, 0.0, f"incarnation {self.incarnation} of worker {self.worker_id} ended: {exc}")
            return False

    @staticmethod
    def _arrival_mb(b: pb.InputBinding, mb: int) -> int:
        return mb if b.kind == B.REF and b.producer_per_microbatch else -1

    def _ready(self, n: _Node, step: int, mb: int) -> bool:
        name = n.prog.name
        for b in n.prog.inputs:
            if b.kind in (B.STEP, B.MICROBATCH):
                continue
            if b.kind == B.STATE and b.state in self.states:
                if self.states[b.state].at(step) is None:
                    return False
            elif b.kind == B.GATHER:
                if any((name, b.arg, step, i) not in self._inbox for i in range(self.m)):
                    return False
            elif (name, b.arg, step, self._arrival_mb(b, mb)) not in self._inbox:
                return False
        return True

    def _take_inputs(self, n: _Node, step: int, mb: int) -> list[Any]:
        name = n.prog.name
        args: list[Any] = []
        for b in n.prog.inputs:
            if b.kind == B.STEP:
                args.append(np.int32(step))
            elif b.kind == B.MICROBATCH:
                args.append(np.int32(mb if mb >= 0 else 0))
            elif b.kind == B.STATE and b.state in self.states:
                args += self.states[b.state].use(step)
            elif b.kind == B.GATHER:
                parts = [self._inbox.take((name, b.arg, step, i)) for i in range(self.m)]
                args += [np.stack(xs) for xs in zip(*parts, strict=True)]
            else:
                args += self._inbox.take((name, b.arg, step, self._arrival_mb(b, mb)))
        return args

    # -- results -------------------------------------------------------------------------

    def _complete(self, n: _Node, step: int, mb: int, leaves: Leaves, compute_s: float, picked: float) -> None:
        self.completed += 1
        self.records.ran(n.prog.name, step, mb, compute_s)
        done = pb.InstanceDone(node=n.prog.name, step=step, microbatch=mb, compute_s=compute_s,
                               saving_s=self._saving_s.pop(n.prog.slice, 0.0))
        if (first := n.call.first_report()) is not None:  # where the executable came from, and its compile time
            done.program_source, done.compile_s = first
        i = 0
        new_state = False
        for out in n.prog.outputs:
            value, i = leaves[i : i + out.leaves], i + out.leaves
            for metric in out.metrics:
                done.metrics[metric] = float(value[0])
            for r in n.routes.get(out.name, ()):
                header = pb.TransferHeader(job=self.job, node=n.prog.name, output=out.name, step=step,
                                           microbatch=mb, consumer_node=r.consumer_node, arg=r.arg)
                self._route(r, header, value)
            if out.updates_state:
                self.states[out.updates_state].add(step + 1, value)
                new_state = True
        if new_state:
            self._pump_state_pushes()
        done.busy_s = max(0.0, time.perf_counter() - picked - compute_s)
        self._publish(done)

    def _pump_state_pushes(self) -> None:
        """Push each remote consumer every granted step's version of a state once it exists."""
        hi = min(self.until, self.steps)
        for sr in self._state_routes:
            sv = self.states[sr.route.state]
            while sr.next_step < hi:
                if not runs_at(sr.next_step, sr.route.consumer_every):
                    sr.next_step += 1  # the consumer does not run at this step: nothing to send
                    continue
                if sv.at(sr.next_step) is None:
                    break
                header = pb.TransferHeader(job=self.job, state=sr.route.state, step=sr.next_step, microbatch=-1,
                                           consumer_node=sr.route.consumer_node, arg=sr.route.arg)
                self._route(sr.route, header, sv.use(sr.next_step))
                sr.next_step += 1

    def _route(self, r: pb.Route, header: pb.TransferHeader, value: Leaves) -> None:
        header.leaves = len(value)
        header.to.CopyFrom(pb.Identity(cluster=self.cluster, worker_id=r.worker_id, incarnation=r.incarnation))
        header.from_worker, header.from_incarnation = self.worker_id, self.incarnation
        if r.worker_id == self.worker_id:
            self._deliver_locked(header, value)
        elif not self.stopped:
            self.outlog.put(header, value)
            self._pushes.submit((r.worker_id, int(r.incarnation)), self._push, r.data_address or r.address, header,
                                value, bool(r.data_address))

    def flush(self, timeout_s: float) -> bool:
        """Wait until every push submitted so far has ended (a drain, before unloading); whether they all did."""
        done, left = self._pushes.wait_idle(timeout_s)
        if not done:
            self.log.warning("job.flush_timed_out", pending=left, timeout_s=timeout_s)
        return done

    def _push(self, address: str, header: pb.TransferHeader, value: Leaves, data_plane: bool) -> None:
        def may_act() -> None:
            try:
                self._admit(pb.Identity(cluster=self.cluster, worker_id=self.worker_id, incarnation=self.incarnation))
            except RallypointError as exc:
                raise NotAllowed(str(exc)) from exc

        target = (header.to.worker_id, header.to.incarnation)

        def cancelled() -> bool:  # unloaded, or recovery moved the consumer (the log holds the value)
            return self.stopped or target not in self._targets

        self._peers.push(address, header, value, may_act=may_act, cancelled=cancelled, log=self.log,
                         data_plane=data_plane)

    def _deliver_locked(self, header: pb.TransferHeader, leaves: Leaves) -> bool:
        if self.stopped:
            return False
        n = self.nodes.get(header.consumer_node)
        if n is None:
            raise DeliveryError(f"job {self.job!r}: node {header.consumer_node!r} is not loaded on worker {self.worker_id}")
        b = next((b for b in n.prog.inputs if b.arg == header.arg), None)
        if b is None or b.kind in (B.STEP, B.MICROBATCH) or (b.kind == B.STATE and b.state in self.states):
            raise DeliveryError(f"job {self.job!r}: node {n.prog.name!r} takes no pushed input {header.arg!r}")
        step, mb = int(header.step), int(header.microbatch)
        per_mb_value = b.kind == B.GATHER or (b.kind == B.REF and b.producer_per_microbatch)
        if not 0 <= step < self.steps or not (0 <= mb < self.m if per_mb_value else mb == -1):
            raise DeliveryError(f"job {self.job!r}: {n.prog.name}.{header.arg} has no step {step} microbatch {mb}")
        if len(leaves) != b.leaves:
            raise DeliveryError(f"job {self.job!r}: {n.prog.name}.{header.arg} takes {b.leaves} leaves, got {len(leaves)}")
        if not runs_at(step, n.prog.every):
            return False  # the consumer does not run at this step: nothing needs it
        key: Key = (n.prog.name, header.arg, step, mb)
        consumer_mb = (mb if mb >= 0 else 0) if n.prog.per_microbatch else -1
        if key in self._inbox or n.progress.is_started(step, consumer_mb):
            return True
        self._inbox.put(key, leaves, self.m if n.prog.per_microbatch and mb < 0 else 1)
        return False

    def _publish(self, ev: pb.InstanceDone) -> None:
        ev.log_bytes, ev.log_spilled_bytes = self.outlog.memory_bytes, self.outlog.spilled_bytes
        self._events.publish(ev)

    def _fail_job(self, error: str) -> None:
        if not self.error:
            self.error = error
            self.log.error("job.failed", error=error)
            self._publish(pb.InstanceDone(error=error))
            self._cv.notify_all()

    def _fail(self, n: _Node, step: int, mb: int, compute_s: float, error: str) -> None:
        if self.error:
            return
        self.error = f"{n.prog.name} step {step} microbatch {mb}: {error}"
        self.log.error("instance.failed", node=n.prog.name, step=step, microbatch=mb, error=error)
        self._publish(pb.InstanceDone(node=n.prog.name, step=step, microbatch=mb, compute_s=compute_s, error=error))
        self._cv.notify_all()
