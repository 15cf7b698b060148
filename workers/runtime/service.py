"""The worker's runtime service: the gRPC and data-plane front of :class:`rallypoint.workers.runtime.runtime.JobRuntime`.

Every request passes the daemon's gate first (fence, incarnation, coordinator term);
then it is routed to the job it names. ``PushReplica`` and ``FetchReplica`` serve the
in-memory checkpoint tier (:mod:`rallypoint.workers.checkpoints.replicas`): the copies this worker
holds for peers live here, beside the runtimes, since a holder may run no part of the job.
``WarmJob`` serves warm spares (:mod:`rallypoint.workers.warm`): the executables a spare
compiles for jobs it may take over live here too, until a ``LoadJob`` uses them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from typing import Any, NoReturn

import grpc

from rallypoint.basics import authz
from rallypoint.basics.errors import RallypointError
from rallypoint.basics.logs import get_logger
from rallypoint.basics.tls import TlsConfig
from rallypoint.proto import codec
from rallypoint.proto.errors import corrupt_checkpoint_metadata, member_lost_metadata, program_failed_metadata
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc
from rallypoint.workers import meter
from rallypoint.workers.gang.group import GroupLost
from rallypoint.workers.gang.link import Bind, MemberPool, relay
from rallypoint.workers.gang.pieces import PieceAssembler, PieceError, whole_header
from rallypoint.workers.code import CodeCache
from rallypoint.workers.sources.sandbox import SourcePolicy
from rallypoint.workers.dataplane import Status
from rallypoint.workers.corruption import corruption_hook
from rallypoint.workers.faults import NO_FAULTS, WorkerFaults
from rallypoint.workers.runtime.checkpoints import CommitFn
from rallypoint.workers.checkpoints.replicas import ReplicaStore, ReplicaTier
from rallypoint.workers.runtime.runtime import JobRuntime
from rallypoint.workers.runtime.control import Admit
from rallypoint.workers.runtime.events import drain_events
from rallypoint.workers.runtime.load import ProgramFailed
from rallypoint.workers.errors import DeliveryError, LoadError, RestoreError
from rallypoint.workers.transfer import PeerChannels
from rallypoint.workers.warm import WarmCache


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")


class WorkerRuntimeService(pb_grpc.WorkerRuntimeServicer):
    """The ``WorkerRuntime`` gRPC service of one worker: one :class:`JobRuntime` per loaded job.

    Every RPC first passes ``admit`` (the daemon's fence and incarnation gate);
    refused requests get FAILED_PRECONDITION, unknown jobs NOT_FOUND.

    Args:
        worker_id: this worker.
        admit: raises (a :class:`RallypointError`) when a request may not act.
        devices: the local devices, or a callable returning them (resolved at the first load).
        incarnation: this worker's current incarnation (0: not registered).
        push_threads: threads per job pushing outputs to other workers.
        commit_factory: makes the checkpoint commit of the current incarnation (None: jobs do not checkpoint).
        faults: test fault hooks every job's checkpoints get (:mod:`rallypoint.workers.faults`).
        admit_leader: the gate of the leader's methods when the caller is the leader
            (:func:`rallypoint.basics.authz.moves_term`): it may also raise the worker's newest term
            (None: ``admit``). Every other request passes ``admit``, which only checks the term.
    """

    def __init__(self, worker_id: str, *, admit: Admit, devices: Sequence[Any] | Callable[[], Sequence[Any]],
                 incarnation: Callable[[], int], push_threads: int = 4,
                 commit_factory: Callable[[], CommitFn] | None = None, faults: WorkerFaults = NO_FAULTS,
                 tls: TlsConfig | None = None, admit_leader: Admit | None = None) -> None:
        self._commit_factory = commit_factory
        self._faults = faults
        self.worker_id = worker_id
        self._admit_fn = admit
        self._admit_leader = admit_leader or admit
        self._tls = tls
        self._devices = devices
        self._incarnation = incarnation
        self._push_threads = push_threads
        self._lock = threading.Lock()
        self._jobs: dict[str, JobRuntime] = {}
        self._loading: dict[str, threading.Event] = {}  # job -> set by an UnloadJob while its load is under way
        self.peers = PeerChannels(tls)  # pushes to peers: mutual TLS with this worker's identity
        self.log = get_logger("rallypoint.runtime", worker=worker_id)
        self.corrupt = corruption_hook(faults.corrupt_flag, worker_id)  # the `corrupt` fault (None: off)
        self.replicas = ReplicaTier(worker_id, self.peers, ReplicaStore(
            corrupt=faults.corrupt_replicas, log=get_logger("rallypoint.replicas", worker=worker_id)))
        self.warm = WarmCache(log=get_logger("rallypoint.warm", worker=worker_id))
        self.code = CodeCache()  # the jobs' code bundles, unpacked once per hash (host sources)
        self.member_host = "127.0.0.1"  # the host others reach this worker at (the daemon sets it): members listen there
        self.member_platform = "cpu"  # the platform of this worker's devices (the daemon sets it): its members' JAX
        self.pieces = PieceAssembler()  # values arriving from a multi-host slice's members, each its shards
        self.member_pool = MemberPool()  # members started ahead (the daemon's --member-pool; empty: none)
        self.member_tls = (str(tls.ca), str(tls.cert), str(tls.key)) if tls else ()  # its members push with them
        self.member_compile_cache = ""  # the worker's compilation cache (the daemon sets it): its members' too
        self.source_policy = SourcePolicy()  # what its host sources may reach (the daemon sets it: sandbox.py)
        self.member_bind: Bind | None = None  # the daemon's check of a member's device leases (None: unbound)

    # -- helpers -------------------------------------------------------------------------

    def _admit(self, to: pb.Identity, context: grpc.ServicerContext, *, leader: bool = False) -> None:
        """The daemon's gate; ``leader``: one of the leader's methods, whose term moves the worker's newest term
        when the caller is the leader (a coordinator-role certificate; any caller with plain TCP)."""
        if to.worker_id and to.worker_id != self.worker_id:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                   f"request for worker {to.worker_id!r} reached worker {self.worker_id!r}")
        gate = self._admit_leader if leader and authz.moves_term(context, self._tls) else self._admit_fn
        try:
            gate(to)
        except RallypointError as exc:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    def _job(self, to: pb.Identity, job: str, context: grpc.ServicerContext, *, leader: bool = True) -> JobRuntime:
        self._admit(to, context, leader=leader)
        with self._lock:
            rt = self._jobs.get(job)
        if rt is None:
            _abort(context, grpc.StatusCode.NOT_FOUND, f"job {job!r} is not loaded on worker {self.worker_id}")
        return rt

    def receive(self, header: pb.TransferHeader, leaves: list[Any]) -> tuple[Status, str]:
        """A value from the data plane (workers/dataplane.py): the same gate and path as ``Push``."""
        if header.to.worker_id and header.to.worker_id != self.worker_id:
            return Status.INVALID, f"value for worker {header.to.worker_id!r} reached worker {self.worker_id!r}"
        try:
            self._admit_fn(header.to)
        except RallypointError as exc:
            return Status.REFUSED, str(exc)
        rt = self.loaded(header.job)
        if rt is None:
            return Status.NO_JOB, f"job {header.job!r} is not loaded on worker {self.worker_id}"
        meter.transferred("received", leaves)
        if header.pieces:  # a multi-host slice's output, each member sending its shards (workers/gang/pieces.py)
            try:
                whole = self.pieces.add(header, leaves)
            except PieceError as exc:
                return Status.INVALID, str(exc)
            if whole is None:
                return Status.DELIVERED, ""  # kept until the value's other pieces are here
            header, leaves = whole_header(header), whole
        try:
            return (Status.DUPLICATE if rt.deliver(header, leaves) else Status.DELIVERED), ""
        except DeliveryError as exc:
            return Status.INVALID, str(exc)

    def loaded(self, job: str) -> JobRuntime | None:
        """The runtime of ``job`` if it is loaded here."""
        with self._lock:
            return self._jobs.get(job)

    def runtimes(self) -> list[JobRuntime]:
        """Every job loaded here now."""
        with self._lock:
            return list(self._jobs.values())

    def _device_list(self) -> list[Any]:
        devs = self._devices() if callable(self._devices) else self._devices
        return list(devs)

    def close(self) -> None:
        """Unload every job and close the peer channels."""
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
        for rt in jobs:
            rt.stop()
        self.peers.close()
        self.code.close()
        self.member_pool.close()

    # -- RPCs ------------------------------------------------------------------------------

    def LoadJob(self, request: pb.LoadJobRequest, context: grpc.ServicerContext) -> pb.LoadJobResponse:
        self._admit(request.to, context, leader=True)
        with self._lock:
            stale = self._jobs.get(request.job)
            if stale is not None and stale.incarnation != self._incarnation():
                del self._jobs[request.job]  # left by an incarnation that ended: it can no longer act
            else:
                stale = None
            busy = request.job in self._jobs or request.job in self._loading
            cancel = threading.Event()
            if not busy:
                self._loading[request.job] = cancel
        if stale is not None:
            self.log.info("job.stale_unloaded", job=request.job, incarnation=stale.incarnation)
            try:
                stale.stop()
            except Exception:
                if not busy:
                    with self._lock:
                        self._loading.pop(request.job, None)
                raise
        if busy:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                   f"job {request.job!r} is already loaded or loading on worker {self.worker_id}: unload it first")
        failure: tuple[grpc.StatusCode, str] | None = None
        metadata: tuple[tuple[str, str], ...] = ()
        try:
            rt = JobRuntime(request, worker_id=self.worker_id, devices=self._device_list(), admit=self._admit_fn,
                            incarnation=self._incarnation, peers=self.peers, push_threads=self._push_threads,
                            commit_factory=self._commit_factory, faults=self._faults, replicas=self.replicas,
                            corrupt=self.corrupt, warm=self.warm, code=self.code, source_policy=self.source_policy,
                            cancel=cancel)
        except RestoreError as exc:
            failure = (grpc.StatusCode.DATA_LOSS, str(exc))
            metadata = corrupt_checkpoint_metadata(exc.slice_name, exc.step)
        except LoadError as exc:
            failure = (grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ProgramFailed as exc:  # the job's own program: typed, so the coordinator blames no worker
            failure = (grpc.StatusCode.INTERNAL, f"loading job {request.job!r}: {exc}")
            metadata = program_failed_metadata(exc.part, exc.error)
        except Exception as exc:  # this worker's own failure (a device, the host): report it, do not kill the server
            failure = (grpc.StatusCode.INTERNAL, f"loading job {request.job!r}: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                if self._loading.get(request.job) is cancel:
                    del self._loading[request.job]
                if failure is None and cancel.is_set():  # unloaded meanwhile: it must not run
                    failure = (grpc.StatusCode.ABORTED, f"job {request.job!r} was unloaded from worker "
                                                        f"{self.worker_id} while it loaded")
                elif failure is None:
                    self._jobs[request.job] = rt
        if failure is not None and cancel.is_set() and failure[0] is grpc.StatusCode.ABORTED:
            rt.stop()
        if failure is not None:
            self.log.error("job.load_failed", job=request.job, error=failure[1], code=failure[0].name)
            if metadata:
                context.set_trailing_metadata(metadata)
            _abort(context, *failure)
        self.warm.loaded(request)  # no spare of this job any more; its devices are taken
        rt.start()
        return pb.LoadJobResponse(load_s=rt.load_s, restore_tiers=rt.restore_tiers, program_sources=rt.program_sources)

    def RunSteps(self, request: pb.RunStepsRequest, context: grpc.ServicerContext) -> pb.RunStepsResponse:
        self._job(request.to, request.job, context).grant(int(request.until_step), int(request.cut_step),
                                                          int(request.save_at))
        return pb.RunStepsResponse()

    def Rewire(self, request: pb.RewireRequest, context: grpc.ServicerContext) -> pb.RewireResponse:
        rt = self._job(request.to, request.job, context)
        try:
            resent = rt.rewire(request.routes, request.resend_to, int(request.from_step), int(request.until_step))
            if rt.replicator is not None:
                rt.replicator.set_targets(request.replica_targets)
        except DeliveryError as exc:
            _abort(context, grpc.StatusCode.OUT_OF_RANGE, str(exc))
        except LoadError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.RewireResponse(resent=resent, log_from=rt.outlog.low)

    def Push(self, request_iterator: Iterable[pb.TransferChunk], context: grpc.ServicerContext) -> pb.PushResponse:
        it = iter(request_iterator)
        first = next(it, None)
        if first is None or not first.HasField("header"):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "transfer stream does not start with a header")
        rt = self._job(first.header.to, first.header.job, context, leader=False)  # a peer's: checks, never moves, the term
        try:
            header, leaves = codec.assemble(chain([first], it))
            meter.transferred("received", leaves)
            duplicate = rt.deliver(header, leaves)
        except (ValueError, DeliveryError) as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.PushResponse(duplicate=duplicate)

    def JobEvents(self, request: pb.JobEventsRequest, context: grpc.ServicerContext) -> Iterator[pb.InstanceDoneBatch]:
        rt = self._job(request.to, request.job, context)
        q = rt.subscribe()
        context.send_initial_metadata(())  # the caller may wait for this: from here on no event is missed
        try:
            while context.is_active():
                try:
                    batch, ended = drain_events(q, timeout_s=0.25)
                except queue.Empty:
                    continue
                if batch.done:
                    yield batch
                if ended:
                    return
        finally:
            rt.unsubscribe(q)

    def FetchState(self, request: pb.FetchStateRequest, context: grpc.ServicerContext) -> Iterator[pb.StateValue]:
        rt = self._job(request.to, request.job, context)
        while not rt.wait_finished(0.25):
            if rt.error:
                _abort(context, grpc.StatusCode.ABORTED, f"job {rt.job!r} failed: {rt.error}")
            if rt.stopped:
                _abort(context, grpc.StatusCode.ABORTED, f"job {rt.job!r} was unloaded before it finished")
            if not context.is_active():
                return
        try:
            states = rt.final_states()  # a multi-host slice's states are gathered from its members here
        except GroupLost as exc:  # typed, so the coordinator recovers the member's loss (docs/multihost.md)
            self.log.warning("fetch.member_lost", job=rt.job, member=exc.member, member_worker=exc.worker,
                             error=str(exc))
            context.set_trailing_metadata(member_lost_metadata(exc.worker, str(exc)))
            _abort(context, grpc.StatusCode.ABORTED, f"job {rt.job!r}: fetching its final state: {exc}")
        yield from states

    def UnloadJob(self, request: pb.UnloadJobRequest, context: grpc.ServicerContext) -> pb.UnloadJobResponse:
        self._admit(request.to, context, leader=True)
        with self._lock:
            rt = self._jobs.pop(request.job, None)
            loading = self._loading.pop(request.job, None)
        if loading is not None:  # a load under way (a gang forming on a hung worker) ends now and leaves nothing
            self.log.warning("job.load_cancelled", job=request.job)
            loading.set()
        if rt is not None:
            if request.flush_s > 0:  # a drain: what this worker sent before it stopped must arrive
                rt.flush(float(request.flush_s))
            rt.abort_groups()  # before the job's lock, which a slice thread in a request to a lost member holds
            finished = rt.wait_finished(0)
            rt.stop()
            if finished:  # the job ran to its end here: the copies held for it are of no more use
                self.replicas.store.drop_job(request.job)
                self.warm.drop_job(request.job)
        return pb.UnloadJobResponse()

    def PushReplica(self, request_iterator: Iterable[pb.ReplicaChunk],
                    context: grpc.ServicerContext) -> pb.PushReplicaResponse:
        it = iter(request_iterator)
        first = next(it, None)
        if first is None or not first.HasField("header"):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "replica stream does not start with a header")
        self._admit(first.header.to, context)
        try:
            header, states = codec.assemble_replica(chain([first], it), max_bytes=self.replicas.store.limit_bytes)
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        stored, reason = self.replicas.receive(header, states)
        return pb.PushReplicaResponse(stored=stored, reason=reason)

    def FetchReplica(self, request: pb.FetchReplicaRequest, context: grpc.ServicerContext) -> Iterator[pb.ReplicaChunk]:
        self._admit(request.to, context)
        r = self.replicas.store.get(request.job, request.slice, int(request.step))
        if r is None:
            _abort(context, grpc.StatusCode.NOT_FOUND, f"worker {self.worker_id} holds no copy of job "
                   f"{request.job!r} slice {request.slice!r} at step {request.step}")
        yield from codec.replica_chunks(pb.ReplicaHeader(
            job=r.job, slice=r.slice_name, step=r.step, checksum=r.checksum, from_worker=r.from_worker,
            from_incarnation=r.from_incarnation), r.states)

    def WarmJob(self, request: pb.WarmJobRequest, context: grpc.ServicerContext) -> pb.WarmJobResponse:
        """Compile the programs of the slices this spare could take over (none: drop what it holds for the job)."""
        self._admit(request.to, context, leader=True)
        if self.loaded(request.job) is not None and request.slices:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                   f"job {request.job!r} runs on worker {self.worker_id}: it is no spare of that job")
        try:
            resp = self.warm.warm(request, self._device_list())
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # a worker that a new gang of the job may be formed on keeps member processes started, JAX imported (their
        # programs' executables are in the worker's compilation cache once any member compiled them)
        self.member_pool.hold(request.job, max(0, int(request.members)), self.member_platform)
        return resp

    def Member(self, request_iterator: Iterator[pb.MemberChunk],
               context: grpc.ServicerContext) -> Iterator[pb.MemberChunk]:
        """A multi-host slice's member process on this worker, relayed (:mod:`rallypoint.workers.gang.link`)."""
        first = next(request_iterator, None)
        if first is None:
            return
        self._admit(first.to, context)
        yield from relay(chain([first], request_iterator), context, host=self.member_host,
                         platform=self.member_platform, worker=self.worker_id, pool=self.member_pool,
                         tls=self.member_tls, compile_cache=self.member_compile_cache, bind=self.member_bind)
