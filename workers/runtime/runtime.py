"""The worker runtime: loaded jobs, one device thread per slice, worker-to-worker pushes.

The coordinator loads a job on each worker that holds one of its slices
(``LoadJob``: exported programs, state inits and a routing table), grants steps
(``RunSteps``), hears completions (``JobEvents``) and fetches the final state
(``FetchState``). Tensors never go through it: a worker runs an instance as soon as
its inputs have arrived and its step is granted, and pushes each output straight to
the consuming worker (over its data plane, :mod:`rallypoint.workers.dataplane`, or a gRPC
``Push``), or hands it over in memory when the consumer is its own. The gRPC and
data-plane front is :mod:`rallypoint.workers.runtime.service`. The semantics are those of
:class:`rallypoint.client.reference.ReferenceExecutor`, so a run ends in bitwise the same state:

* an instance is ``(node, step, microbatch)``; a node runs at steps divisible by its
  ``every``; microbatch is -1 for per-step nodes;
* a state read at step ``s`` is the value its producer made at the last step before
  ``s`` (the init before that); resident states are read in place, others arrive by
  push, once per step;
* a gather stacks the step's microbatch values on a new axis 0 (on the devices);
* delivery is idempotent per ``(consumer, arg, step, microbatch)``.

Instances of one slice run one at a time, lowest step first, then topological
position, then microbatch; different slices run in parallel.

Recovery (docs/recovery.md): slices checkpoint at the job's checkpoint steps
(:mod:`rallypoint.workers.runtime.checkpoints`), pushed values stay in the output log (:mod:`rallypoint.workers.runtime.outlog`)
until the cut passes them, a runtime can start from a checkpoint (``start_step``), and
``rewire`` points routes at moved consumers and sends them their logged inputs again.

How the runtime is built: :class:`JobRuntime` wires the pieces of one loaded job, each
a class that owns its part (all of them work under the one lock of the job's control):

* ``control`` (:class:`~rallypoint.workers.runtime.control.JobControl`): the lock, who the
  job runs as and the daemon's gate, the grant ``until``, ``stopped``, ``error``, the events;
* loading (:mod:`rallypoint.workers.runtime.load`): a mesh per slice, the node programs,
  each resident state's first version (its init, or the restored checkpoint);
* ``inputs`` (:class:`~rallypoint.workers.runtime.inputs.Inputs`): receiving values, the
  inbox, and what each instance reads;
* ``router`` (:class:`~rallypoint.workers.runtime.routes.Router`): the routing table; each
  output and state push to its consumer, here in memory or through the outbox;
* ``outbox`` (:class:`~rallypoint.workers.runtime.outbox.Outbox`): the output log
  (``outlog``) and the pushes to other workers;
* ``handoff`` (:class:`~rallypoint.workers.runtime.handoff.CheckpointHandoff`): when each
  slice saves and what, the commits, the in-memory tier's ``replicator``;
* ``scheduler`` (:class:`~rallypoint.workers.runtime.scheduler.SliceScheduler`): one device
  thread per slice that picks ready instances and runs them.

The runtime itself keeps ``nodes`` and ``states``, made at load and shared by reference
(each node's ``progress`` is the scheduler's; a state's versions are added by the
scheduler, read by the inputs, pushed by the router and pinned by the hand-off), and
the instance ``records``. The gRPC calls land on its methods.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rallypoint.proto import codec, rallypoint_pb2 as pb
from rallypoint.workers.corruption import StateCorruption
from rallypoint.workers.faults import NO_FAULTS, WorkerFaults
from rallypoint.workers.runtime.checkpoints import CommitFn, restore_for_load
from rallypoint.workers.code import CodeCache, CodeError
from rallypoint.workers.gang.lead import GangSlice
from rallypoint.workers.gang.checkpoint import GangCheckpointer
from rallypoint.workers.gang.replicas import part_targets
from rallypoint.workers.sources.host import start_host_sources
from rallypoint.workers.sources.sandbox import SourcePolicy
from rallypoint.workers.runtime.outlog import OutputLog
from rallypoint.workers.runtime.records import InstanceRecords
from rallypoint.workers.checkpoints.replicas import Replicator, ReplicaTier
from rallypoint.workers.residency import Copies, to_host
from rallypoint.workers.runtime.control import Admit, JobControl
from rallypoint.workers.runtime.handoff import CheckpointHandoff
from rallypoint.workers.runtime.inputs import Inputs
from rallypoint.workers.runtime.load import (ProgramFailed, load_nodes, load_skips, load_states, nodes_by_slice,
                                             slice_meshes)
from rallypoint.workers.runtime.outbox import Outbox
from rallypoint.workers.runtime.routes import Router
from rallypoint.workers.runtime.scheduler import SliceScheduler
from rallypoint.workers.errors import DeliveryError
from rallypoint.workers.runtime.state import Leaves, StateVersions
from rallypoint.workers.transfer import PeerChannels
from rallypoint.workers.warm import WarmCache

DEFAULT_LOG_LIMIT = 256 << 20  # output log bytes in memory when the request names none


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
        corrupt: the worker's ``corrupt`` fault hook (:mod:`rallypoint.workers.corruption`; None: off, always in
            production).
        replicas: the worker's in-memory checkpoint tier (:mod:`rallypoint.workers.checkpoints.replicas`; None: disk only).
        warm: executables compiled ahead for this worker (:mod:`rallypoint.workers.warm`; None: compile at first calls).
        cancel: set by an unload while this load is under way: a gang still forming gives up at once.

    Raises:
        LoadError: the request does not fit this worker (devices, slices, routes, leaves).
        RestoreError: a checkpoint to start from does not read back as committed.
        ProgramFailed: the job's own program failed here (an init, a program that does not deserialize).
    """

    def __init__(self, req: pb.LoadJobRequest, *, worker_id: str, devices: Sequence[Any], admit: Admit,
                 incarnation: Callable[[], int], peers: PeerChannels, push_threads: int = 4,
                 commit_factory: Callable[[], CommitFn] | None = None, faults: WorkerFaults = NO_FAULTS,
                 replicas: ReplicaTier | None = None, warm: WarmCache | None = None,
                 corrupt: StateCorruption | None = None, code: CodeCache | None = None,
                 source_policy: SourcePolicy | None = None,
                 cancel: threading.Event | None = None) -> None:
        t0 = time.perf_counter()
        self._source_policy = source_policy
        self._corrupt = corrupt
        self.program_sources: dict[str, str] = {}  # node -> "warm" (compiled ahead) or "cold" (at its first call)
        self.job = req.job
        self.steps = int(req.steps)
        self.start_step = start = int(req.start_step)
        self.m = max(int(req.microbatches), 1)
        self.worker_id = worker_id
        self.copies = Copies(self.job)  # every copy between host and device, by purpose (residency.py)
        self.outlog = OutputLog(int(req.log_limit_bytes) or DEFAULT_LOG_LIMIT, copies=self.copies)
        self.outlog.low = start  # a runtime started at a checkpoint made nothing before it
        self.control = JobControl(self.job, cluster=req.to.cluster, worker_id=worker_id, admit=admit,
                                  incarnation=incarnation, outlog=self.outlog)
        self.incarnation = self.control.incarnation
        self.log = self.control.log
        self.outbox = Outbox(self.control, self.outlog, peers, push_threads, copies=self.copies)
        self.restore_tiers: dict[str, str] = {}  # slice -> "memory" (a peer's copy) or "disk", when restored

        self.gangs: list[GangSlice] = []  # the multi-host slices' groups, formed here (docs/multihost.md)

        def gang(sa: pb.SliceAssignment) -> GangSlice:
            self.gangs.append(GangSlice.form(sa, peers.stub, cluster=req.to.cluster, job=self.job,
                                              cancel=cancel))
            self.log.info("gang.formed", slice=sa.slice, members=[m.worker_id for m in sa.members],
                          formed_s=round(self.gangs[-1].group.formed_s, 3))
            return self.gangs[-1]

        try:
            self._load(req, devices, worker_id, gang, commit_factory, faults, replicas, warm, code, t0)
        except BaseException:
            for g in self.gangs:
                g.abort()
            raise

    def _load(self, req: pb.LoadJobRequest, devices: Sequence[Any], worker_id: str, gang: Callable[..., Any],
              commit_factory: Callable[[], CommitFn] | None, faults: WorkerFaults, replicas: ReplicaTier | None,
              warm: WarmCache | None, code: CodeCache | None, t0: float) -> None:
        start = self.start_step
        self.skips = load_skips(req)
        mesh_of = slice_meshes(req, devices, worker_id, gang)
        self.nodes = load_nodes(req, mesh_of, microbatches=self.m, warm=warm, program_sources=self.program_sources,
                                worker_id=worker_id)
        self._slice_nodes = nodes_by_slice(req, self.nodes)
        self.states: dict[str, StateVersions] = {}  # filled below, once the routes say where each is pushed
        self.inputs = Inputs(self.control, self.nodes, self.states, steps=self.steps, microbatches=self.m,
                             copies=self.copies, skips=self.skips)
        self.router = Router(self.control, self.nodes, {st.name for st in req.states}, self.states, self.inputs,
                             self.outbox, steps=self.steps, start_step=start, copies=self.copies)
        self.router.set_routes(req.routes)
        fetch = (lambda ref: replicas.fetch(req, ref, self.log)) if replicas is not None else None
        gangs = {g.name: g for g in self.gangs}
        restored = restore_for_load(req, fetch, self.restore_tiers, skip=gangs) if start > 0 else {}
        self.states.update(load_states(req, mesh_of, self.nodes, self.router.push_everies, restored, worker_id,
                                       copies=self.copies, tiers=self.restore_tiers))

        self.handoff = CheckpointHandoff(req, self.control, self.states, commit_factory=commit_factory, faults=faults,
                                         replicas=replicas, copies=self.copies,
                                         gangs={s: self._gang_checkpointer(g, replicas is not None, req.to.cluster)
                                                for s, g in gangs.items()})
        self.records = InstanceRecords(self.handoff.checkpoints.root, worker=worker_id, incarnation=self.incarnation,
                                       slices=list(self._slice_nodes), start_step=start, job=self.job,
                                       restored_from=min((int(r.step) for r in req.restore), default=None))
        self.scheduler = SliceScheduler(self.control, self._slice_nodes, inputs=self.inputs, router=self.router,
                                        handoff=self.handoff, records=self.records, states=self.states,
                                        steps=self.steps, start_step=start, copies=self.copies,
                                        corrupt=self._corrupt)
        self._own_code = code is None  # host sources' bundles: the worker's cache, or one of this runtime's
        self._code = code if code is not None else CodeCache()
        try:  # last: nothing after it can fail and leave their processes behind
            self.host_sources = start_host_sources(req, self.nodes, self._code, self.copies, self._source_policy,
                                                   skips=self.skips)
        except CodeError as exc:
            self._close_code()
            raise ProgramFailed("the job's code bundle", worker_id, exc) from exc
        self.load_s = time.perf_counter() - t0
        self.log.info("job.loaded", slices=list(self._slice_nodes), nodes=len(self.nodes), states=list(self.states),
                      steps=self.steps, start_step=start, load_s=round(self.load_s, 3))

    def _gang_checkpointer(self, g: GangSlice, tier: bool, cluster: str) -> Callable[..., GangCheckpointer]:
        """The maker of a multi-host slice's checkpointer: with the in-memory tier, its members copy their shards
        to their own workers and their parts' holders (workers/gang/replicas.py)."""
        targets = (lambda j: part_targets(g, j, self.handoff.replicator)) if tier else None
        return functools.partial(GangCheckpointer, gang=g, targets=targets, cluster=cluster)

    def _close_code(self) -> None:
        if self._own_code:
            self._code.close()

    # -- what the others read --------------------------------------------------------------

    @property
    def replicator(self) -> Replicator | None:
        """The in-memory tier's copies of this job's commits (None: disk only); its targets change on ``Rewire``."""
        return self.handoff.replicator

    @property
    def until(self) -> int:
        return self.control.until

    @property
    def stopped(self) -> bool:
        return self.control.stopped

    @property
    def error(self) -> str:
        return self.control.error

    @property
    def completed(self) -> int:
        return self.scheduler.completed

    @property
    def expected(self) -> int:
        return self.scheduler.expected

    def start(self) -> None:
        """Start the device threads; instances run once steps are granted."""
        self.scheduler.start()

    # -- what the RPCs call -------------------------------------------------------------

    def grant(self, until_step: int, cut_step: int = 0, save_at: int = 0) -> None:
        """Let instances of steps below ``until_step`` run (never lowers the grant).

        ``cut_step``: the job's newest consistent cut; logged outputs and checkpoints
        older than it are no longer needed by any recovery. ``save_at`` (> 0, a drain):
        every slice also checkpoints at that step, off the schedule.
        """
        control = self.control
        with control.cv:
            if save_at > 0:
                self.handoff.save_at(save_at)
            if until_step > control.until and not control.stopped:
                control.until = until_step
                self.router.pump_state_pushes()
                control.cv.notify_all()
        if cut_step > self.outlog.low:
            self.outlog.trim(cut_step)
            self.handoff.set_cut(cut_step)

    def rewire(self, routes: Sequence[pb.Route], resend_to: Sequence[str], from_step: int, until_step: int) -> int:
        """New routes after recovery moved consumers; send ``resend_to`` their logged inputs of steps ``>= from_step``.

        The routes apply all or nothing: a rejected rewire leaves the old ones in place.
        Pushes still retrying towards a worker no route names any more are dropped
        (the log holds their values). The logged values are sent one at a time: a
        spilled one is read back outside the job's lock, and each waits while the
        pushes not yet ended are over the log's limit (so a resend takes time in
        proportion to the bytes it moves). Returns how many values were sent again.

        Raises:
            LoadError: a route that does not fit this job here.
            DeliveryError: the log does not reach back to ``from_step``.
        """
        control, router = self.control, self.router
        with control.cv:
            if from_step < self.outlog.low and resend_to:
                raise DeliveryError(f"job {self.job!r}: the output log of worker {self.worker_id} starts at step "
                                    f"{self.outlog.low}, after the step {from_step} asked for")
            router.set_routes(routes)
            if until_step > control.until:
                control.until = until_step
            router.pump_state_pushes()
            control.cv.notify_all()
        resent = 0
        for header, leaves in self.outlog.iter_entries(resend_to, from_step) if resend_to else ():
            with control.cv:
                control.cv.wait_for(lambda: not router.backlogged or control.stopped)
                if control.stopped:
                    break
                resent += router.resend(routes, [(header, leaves)])
        self.log.info("job.rewired", resend_to=list(resend_to), from_step=from_step, resent=resent)
        return resent

    def deliver(self, header: pb.TransferHeader, leaves: Leaves) -> bool:
        """A value pushed for a consumer on this worker; returns True for a duplicate (dropped).

        The value goes onto the consumer's devices here, before the job's lock is taken.

        Raises:
            DeliveryError: the value matches no input of this job here.
        """
        leaves = self.inputs.placed(header, leaves)
        with self.control.cv:
            duplicate = self.inputs.deliver(header, leaves)
            self.control.cv.notify_all()
        return duplicate

    def subscribe(self) -> queue.Queue[pb.InstanceDone | None]:
        """A queue of this job's ``InstanceDone`` events (:class:`~rallypoint.workers.runtime.events.EventFeed`)."""
        return self.control.events.subscribe()

    def unsubscribe(self, q: queue.Queue[pb.InstanceDone | None]) -> None:
        self.control.events.unsubscribe(q)

    def wait_finished(self, timeout_s: float) -> bool:
        """Wait until every instance of this worker has run, the job failed or it was unloaded."""
        control, scheduler = self.control, self.scheduler
        with control.cv:
            control.cv.wait_for(lambda: scheduler.finished or bool(control.error) or control.stopped, timeout_s)
            return scheduler.finished

    def final_states(self) -> list[pb.StateValue]:
        """Every resident state as it is at step ``steps`` (call once finished), copied off the device (``fetch``)."""
        with self.control.cv:
            final = {name: list(sv.at(self.steps) or []) for name, sv in self.states.items()}
        return [pb.StateValue(state=name, leaves=[codec.to_tensor(a) for a in to_host(leaves, self.copies, "fetch")])
                for name, leaves in final.items()]

    def flush(self, timeout_s: float) -> bool:
        """Wait until every push submitted so far has ended, and the multi-host slices' copies of their commits
        (a drain, before unloading); whether they all did."""
        end = time.monotonic() + timeout_s
        pushed = self.outbox.flush(timeout_s)
        return self.handoff.checkpoints.settle_gangs(max(0.0, end - time.monotonic())) and pushed

    def abort_groups(self) -> None:
        """End the multi-host slices' groups now (any thread; takes no lock): a slice thread in a group request,
        which may hold the job's lock while it puts a value on the group, ends with it (GroupLost)."""
        for g in list(self.gangs):
            g.abort()

    def stop(self) -> None:
        """Stop the threads, end the event streams and drop every value. Idempotent."""
        control = self.control
        self.abort_groups()  # first: a member lost may hold a group request, and with it the job's lock
        with control.cv:
            if control.stopped:
                return
            control.stopped = True
            control.events.close()
            self.inputs.clear()
            for sv in self.states.values():
                sv.clear()
            control.cv.notify_all()
        self.outbox.shutdown()
        for source in self.host_sources:  # a slice waiting for a batch ends with it
            source.close()
        self._close_code()
        self.scheduler.join(5.0)
        replicator = self.handoff.replicator
        for part in (self.handoff.checkpoints, self.outlog, self.records, *([replicator] if replicator else [])):
            try:
                part.close()
            except Exception as exc:  # noqa: BLE001 - e.g. a save a fenced incarnation cannot finalize
                self.log.warning("job.close_failed", part=type(part).__name__, error=f"{type(exc).__name__}: {exc}")
        self.log.info("job.unloaded", completed=self.completed, expected=self.expected)
