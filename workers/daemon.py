"""The worker daemon: one process per accelerator host, and its serving loop.

Its settings are :class:`~rallypoint.workers.config.WorkerConfig`; it finds its devices
with :func:`~rallypoint.workers.platform.discover_local_devices`.

A worker registers itself and its K devices in etcd under an etcd lease, with a
new **incarnation** each time it registers (the create revision of its worker
key: unique and increasing). It serves the ``Worker`` gRPC service; every
request names the incarnation it is meant for, and a worker refuses requests for
another incarnation and refuses everything while fenced.

Fencing: the worker stops acting as soon as its local lease deadline passes
(:class:`rallypoint.etcd.lease.LocalFence`), before it learns anything from etcd.
If etcd then says the lease is gone, the incarnation is over for good: the
worker registers again under a new one. If etcd says the lease is alive (etcd
was briefly unreachable), the worker goes on under the same incarnation.

Lifecycle (one state machine, every transition through ``_set_state``)::

    STARTING -> REGISTERING -> SERVING <-> FENCED
                    ^                        |
                    +---- (lease gone) ------+
    any -> STOPPING -> STOPPED
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from rallypoint.basics.clock import SYSTEM_CLOCK, Clock
from rallypoint.basics.errors import ConfigError, Fenced, RallypointError, StoreError
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.lease import LeaseKeeper
from rallypoint.etcd.records import parsed
from rallypoint.basics.logs import get_logger
from rallypoint.basics.retry import retrying
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.store import Store, created_at
from rallypoint.basics import authz
from rallypoint.basics.tls import PERMIT_KEEPALIVE, add_port
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc
from rallypoint.workers.checkpoints.committer import etcd_commit
from rallypoint.workers.dataplane import DataPlaneServer
from rallypoint.workers.config import WorkerConfig
from rallypoint.workers.sources.sandbox import SourcePolicy, tls_folders
from rallypoint.workers.runtime.checkpoints import CommitFn
from rallypoint.workers.metrics import WorkerMetrics
from rallypoint.workers.gang.link import MemberPool
from rallypoint.workers.gang.member_bounds import leased_dirs
from rallypoint.workers.platform import PlatformInfo, discover_local_devices, platform_info, prepare_environment
from rallypoint.workers.preemption import handle_preemption
from rallypoint.workers.programs import configure_compile_cache
from rallypoint.workers.registration import try_register
from rallypoint.workers.runtime.service import WorkerRuntimeService
from rallypoint.workers.scratch import sweep_orphans


class WorkerState(enum.Enum):
    """Lifecycle states of a worker daemon."""

    STARTING = "starting"
    REGISTERING = "registering"
    SERVING = "serving"
    FENCED = "fenced"
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def is_terminal(self) -> bool:
        return self is WorkerState.STOPPED

    @property
    def may_act(self) -> bool:
        return self is WorkerState.SERVING


@dataclass
class Registration:
    """The current incarnation of this worker."""

    incarnation: int
    keeper: LeaseKeeper
    registered_at: float = field(default_factory=time.time)


class WorkerDaemon(pb_grpc.WorkerServicer):
    """The worker process: registration, keepalive, fencing and the gRPC service."""

    def __init__(self, config: WorkerConfig, *, store: Store | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.keys = Keys(config.cluster)
        self.store = store or EtcdStore(config.endpoints, tls=config.tls)
        self.clock = clock
        self.state = WorkerState.STARTING
        self.registration: Registration | None = None
        self.devices: list[dict[str, Any]] = []
        self.platform = PlatformInfo(platform="cpu", device_kind="cpu", memory_bytes=0, deterministic=True)
        self._server: grpc.Server | None = None
        self.runtime: WorkerRuntimeService | None = None
        self.dataplane: DataPlaneServer | None = None
        self.address = ""
        self.metrics: WorkerMetrics | None = None
        self.max_term = 0  # the newest coordinator term a request came from
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._preempt = threading.Event()
        self._lock = threading.Lock()
        self.log = get_logger("rallypoint.worker", cluster=config.cluster, worker=config.worker_id)

    # -- state machine ----------------------------------------------------------

    def _set_state(self, new: WorkerState, **fields: Any) -> None:
        with self._lock:
            old, self.state = self.state, new
        if old is not new:
            self.log.info("worker.state", previous=old.value, state=new.value, **fields)

    @property
    def incarnation(self) -> int:
        return self.registration.incarnation if self.registration else 0

    # -- start-up and registration ---------------------------------------------------

    def start(self) -> None:
        """Find devices, start the gRPC server, register. Returns once registered."""
        if self.config.discover_devices:
            set_env = prepare_environment(self.config.platform, deterministic=self.config.deterministic)
            self.devices = discover_local_devices(self.config.devices, self.config.platform)
            self.platform = platform_info(self._jax_devices())
            self.log.info("worker.platform", **self.platform.to_record(), environment=set_env)
            if not self.platform.deterministic:
                self.log.warning("worker.nondeterministic_kernels", platform=self.platform.platform,
                                 reason="--xla_gpu_deterministic_ops is off: a replay may not be bitwise")
        else:
            self.devices = [{"index": i, "platform": "cpu", "kind": "cpu", "memory_bytes": 0}
                            for i in range(self.config.devices)]
        # The scratch folders of workers killed on this host before they could remove them: in the background,
        # so that many of them do not hold up the registration (a replacement worker is on a recovery's path).
        threading.Thread(target=sweep_orphans, name="scratch-sweep", daemon=True).start()
        cache = configure_compile_cache(self.config.compile_cache_dir)  # before anything compiles
        if cache is not None:
            self.log.info("worker.compile_cache", directory=str(cache))
        if self.config.faults.any:
            self.log.warning("worker.faults_injected", **dataclasses.asdict(self.config.faults))
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="worker-rpc"),
                                   options=list(PERMIT_KEEPALIVE),  # its peers' and the leader's channels ping
                                   interceptors=authz.interceptors(self.config.tls))  # each method checks the role
        pb_grpc.add_WorkerServicer_to_server(self, self._server)
        self.runtime = WorkerRuntimeService(self.config.worker_id, admit=self.admit, devices=self._jax_devices,
                                            incarnation=lambda: self.incarnation, commit_factory=self._commit_factory,
                                            faults=self.config.faults, tls=self.config.tls,
                                            admit_leader=lambda to: self.admit(to, leader=True))
        pb_grpc.add_WorkerRuntimeServicer_to_server(self.runtime, self._server)
        self.dataplane = DataPlaneServer(self.config.host, self.runtime.receive, port=self.config.data_port,
                                         tls=self.config.tls)
        self.dataplane.start()
        port = add_port(self._server, f"{self.config.host}:{self.config.port}", self.config.tls)
        if port == 0:
            raise ConfigError(f"cannot bind the worker gRPC server to {self.config.host}:{self.config.port}")
        self.address = self.config.advertise_address or f"{self.config.host}:{port}"
        bound = self.config.host
        self.runtime.member_host = bound if bound not in ("", "0.0.0.0", "::") else self.address.rsplit(":", 1)[0]
        self.runtime.member_platform = self.platform.platform or "cpu"  # a gang member's devices: this worker's kind
        self.runtime.member_compile_cache = str(cache or "")  # and its compilation cache
        tls_files = (self.config.tls.ca, self.config.tls.cert, self.config.tls.key) if self.config.tls else ()
        self.runtime.source_policy = SourcePolicy(hide=tls_folders(tls_files) + tuple(self.config.source_hide),
                                                  write=tuple(self.config.source_write),
                                                  mode=self.config.source_sandbox)  # sources never read its keys
        self.runtime.member_bind = functools.partial(leased_dirs, self.store, self.keys, self.config.worker_id)
        if self.config.member_pool:
            self.runtime.member_pool = MemberPool(self.config.member_pool)
            self.runtime.member_pool.fill(self.runtime.member_platform)
        self._server.start()
        if self.config.metrics_port is not None:
            self.metrics = WorkerMetrics(self, host=self.config.host, port=self.config.metrics_port)
            self.log.info("metrics.serving", address=self.metrics.address, url=self.metrics.server.url)
        self.register()

    def _commit_factory(self) -> CommitFn:
        """Checkpoint commits of the current incarnation: a later one's cannot be made by this one."""
        return etcd_commit(self.store, self.keys, created_at(self.keys.worker(self.config.worker_id), self.incarnation))

    def _jax_devices(self) -> list[Any]:
        import jax

        return list(jax.local_devices()[: self.config.devices])

    def jax_devices(self) -> list[Any]:
        """This worker's K local JAX devices (none when it does not list them through JAX: tests)."""
        return self._jax_devices() if self.config.discover_devices else []

    def _record(self) -> dict[str, Any]:
        return {
            "worker": self.config.worker_id,
            "address": self.address,
            "data_address": (self.config.advertise_data_address or self.dataplane.address) if self.dataplane else "",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "devices": len(self.devices),
            **self.platform.to_record(),
            "state": "serving",
            "registered_at": time.time(),
            **({"metrics_address": self.metrics.address} if self.metrics is not None else {}),
        }

    def register(self) -> int:
        """Register a new incarnation: a fresh lease, the worker key and device keys, atomically.

        Waits (up to ``register_timeout_s``) while an older incarnation's key still
        exists, e.g. after a crash and quick restart, until its lease expires.
        """
        self._set_state(WorkerState.REGISTERING)
        keeper = LeaseKeeper(
            self.store,
            self.config.lease_ttl_s,
            who=f"worker {self.config.worker_id}",
            on_lost=self._on_lease_lost,
            clock=self.clock,
            log_fields={"cluster": self.config.cluster, "worker": self.config.worker_id},
        )
        waited: list[int] = []

        def attempt() -> int | None:
            """One try: the incarnation, or None while an older incarnation still holds the id."""
            if self._stop.is_set():
                raise RallypointError("worker stopping during registration")
            if keeper.grant is None or not keeper.fence.valid():
                keeper.acquire()  # no keepalives until registered: a long wait needs a new lease
            incarnation, holder = try_register(
                self.store, self.keys, self.config.worker_id, self._record(), self.devices, keeper.lease_id
            )
            if holder is not None and holder.create_revision not in waited:
                waited.append(holder.create_revision)
                self.log.info("worker.register_waiting", old_incarnation=holder.create_revision)
            return incarnation

        try:
            incarnation = retrying(clock=self.clock, what="registering", log=self.log, retry_on=StoreError,
                                   retry_if_result=lambda inc: inc is None,
                                   stop_after_s=self.config.register_timeout_s, initial_s=0.2, max_s=0.2,
                                   jitter_s=0.05)(attempt)
        except StoreError:
            incarnation = None
        if incarnation is None:
            keeper.stop(revoke=True)
            raise RallypointError(
                f"worker {self.config.worker_id!r} could not register within "
                f"{self.config.register_timeout_s}s: another incarnation still holds the id "
                "or etcd is unreachable; check `rallypoint workers` or raise --register-timeout-s"
            )
        keeper.start_keepalive()
        self.registration = Registration(incarnation=incarnation, keeper=keeper)
        self._set_state(WorkerState.SERVING, incarnation=incarnation)
        self.log.info(
            "worker.registered",
            incarnation=incarnation,
            lease=f"{keeper.lease_id:x}",
            devices=len(self.devices),
            platform=self.platform.platform,
            address=self.address,
            pid=os.getpid(),
        )
        return incarnation

    def _on_lease_lost(self, reason: str) -> None:
        self._wake.set()

    # -- acting --------------------------------------------------------------------

    def admit(self, to: pb.Identity, *, leader: bool = False) -> Registration:
        """Gate of every action: fenced, wrong incarnation or stale coordinator term -> refused.

        Terms are fencing tokens: once a request from term T arrived, requests from a
        coordinator of an older term (a deposed leader) are refused. Only a request the
        leader sent (``leader``: a coordinator-role caller, :func:`rallypoint.basics.authz.moves_term`)
        raises the newest term; any other's term is only checked against it, so a peer (a
        stolen worker certificate) cannot fence the real leader out with a huge term.

        Raises:
            Fenced: the local lease deadline passed, or the lease is gone.
            StaleIncarnation: the request was meant for another incarnation.
            StaleTerm: the request came from a coordinator term older than one already seen.
        """
        reg = self.registration
        if reg is None:
            raise Fenced(f"worker {self.config.worker_id}", "not registered")
        try:
            reg.keeper.fence.check()
        except Fenced:
            if self.state is WorkerState.SERVING:
                self._set_state(WorkerState.FENCED, incarnation=reg.incarnation)
                self.log.warning("worker.fenced", incarnation=reg.incarnation)
            self._wake.set()
            raise
        if to.incarnation and to.incarnation != reg.incarnation:
            raise StaleIncarnation(self.config.worker_id, to.incarnation, reg.incarnation)
        if to.term:
            with self._lock:
                if to.term < self.max_term:
                    raise StaleTerm(self.config.worker_id, to.term, self.max_term)
                if leader:
                    self.max_term = to.term
        return reg

    def _leads(self, context: grpc.ServicerContext) -> bool:
        return authz.moves_term(context, self.config.tls)

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        try:
            reg = self.admit(request.to, leader=self._leads(context))
        except (Fenced, StaleIncarnation, StaleTerm) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.PingResponse(
            worker_id=self.config.worker_id,
            incarnation=reg.incarnation,
            devices=len(self.devices),
            state=self.state.value,
        )

    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> Iterator[pb.Heartbeat]:
        """A stream that lives as long as this process: its break is the fast loss signal."""
        try:
            reg = self.admit(request.to, leader=self._leads(context))
        except (Fenced, StaleIncarnation, StaleTerm) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        interval = min(max(request.interval_s, 0.05), 5.0)
        seq = 0
        while context.is_active() and not self._stop.is_set():
            if self.registration is not reg:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "incarnation ended")
            seq += 1
            yield pb.Heartbeat(
                worker_id=self.config.worker_id,
                incarnation=reg.incarnation,
                seq=seq,
                fenced=not reg.keeper.fence.valid(),
            )
            self._stop.wait(interval)

    # -- main loop -------------------------------------------------------------------

    def step(self) -> None:
        """One iteration of the main loop: fence check, re-register when the lease is gone."""
        reg = self.registration
        if reg is None:
            return
        if reg.keeper.fence.dead:
            self.log.warning("worker.incarnation_ended", incarnation=reg.incarnation)
            for rt in self.runtime.runtimes():  # a multi-host slice's members on other workers go with it
                rt.abort_groups()
            reg.keeper.stop(revoke=False)
            self.registration = None
            self.register()
        elif not reg.keeper.fence.valid():
            if self.state is WorkerState.SERVING:
                self._set_state(WorkerState.FENCED, incarnation=reg.incarnation)
                self.log.warning("worker.fenced", incarnation=reg.incarnation)
        elif self.state is WorkerState.FENCED:
            self._set_state(WorkerState.SERVING, incarnation=reg.incarnation)
            self.log.info("worker.unfenced", incarnation=reg.incarnation)

    def run(self) -> None:
        """Serve until :meth:`stop` is called."""
        while not self._stop.is_set():
            reg = self.registration
            wait = 0.1
            if reg is not None and reg.keeper.fence.valid():
                wait = min(max(reg.keeper.fence.remaining_s(), 0.01), 0.5)
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                break
            if self._preempt.is_set():
                self._preempted()
                break
            try:
                self.step()
            except RallypointError as exc:
                self.log.error("worker.step_failed", error=str(exc))
                self.clock.sleep(0.5)

    def request_preemption(self) -> None:
        """A preemption notice (SIGTERM; safe from a signal handler): :meth:`run` asks for a drain, then returns.

        A second notice while it waits stops at once."""
        if self._preempt.is_set():
            self.request_stop()
        self._preempt.set()
        self._wake.set()

    def _preempted(self) -> None:
        reg = self.registration
        if reg is None or not reg.keeper.fence.valid() or self.config.preempt_deadline_s <= 0:
            return
        deadline = self.config.preempt_deadline_s
        handle_preemption(self.store, self.keys, self.config.worker_id, lease_id=reg.keeper.lease_id,
                          deadline_s=deadline, clock=self.clock, log=self.log, stop=self._stop)

    def request_stop(self) -> None:
        """Ask :meth:`run` to return (safe from a signal handler)."""
        self._stop.set()
        self._wake.set()

    def stop(self) -> None:
        """Leave the cluster cleanly: mark the record leaving, revoke the lease, stop serving."""
        self._set_state(WorkerState.STOPPING)
        self._stop.set()
        self._wake.set()
        reg = self.registration
        if reg is not None and reg.keeper.fence.valid():
            wkey = self.keys.worker(self.config.worker_id)
            try:
                kv = self.store.get(wkey)
                if kv is not None and kv.create_revision == reg.incarnation and \
                        (mine := parsed(kv, "worker")) is not None:
                    record = mine | {"state": "leaving"}
                    self.store.put(wkey, json.dumps(record), lease=reg.keeper.lease_id)
            except StoreError as exc:
                self.log.warning("worker.leave_failed", error=str(exc))
        if reg is not None:
            reg.keeper.stop(revoke=True)
        if self.dataplane is not None:
            self.dataplane.stop()
        if self.runtime is not None:
            self.runtime.close()  # unload jobs, close peer channels
        if self._server is not None:
            self._server.stop(grace=0.5)
        self.store.close()
        if self.metrics is not None:
            self.metrics.close()
        self._set_state(WorkerState.STOPPED, incarnation=reg.incarnation if reg else 0)


class StaleIncarnation(RallypointError):
    """A request named an incarnation of this worker that is not the current one."""

    def __init__(self, worker: str, asked: int, current: int) -> None:
        super().__init__(
            f"worker {worker}: request for incarnation {asked} refused, current incarnation is {current}"
        )
        self.asked = asked
        self.current = current


class StaleTerm(RallypointError):
    """A request came from a coordinator term older than one this worker already obeyed."""

    def __init__(self, worker: str, asked: int, newest: int) -> None:
        super().__init__(
            f"worker {worker}: request from coordinator term {asked} refused, term {newest} already leads"
        )
        self.asked = asked
        self.newest = newest
