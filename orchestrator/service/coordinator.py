"""The coordinator service: leader election, membership, liveness, fencing.

Several coordinators run; one leads (see :mod:`rallypoint.orchestrator.control.election`). The
leader watches membership, keeps an ``Attach`` stream open to every worker (its
break is the fast signal of a dead process: :mod:`~rallypoint.orchestrator.service.links`),
and when a worker is lost:

1. fences it: revokes its etcd lease (unless it already expired), which deletes
   its worker key, its device keys and the device leases it held, atomically;
2. records the loss (``lost/<worker>``) with a fenced write;
3. logs ``worker.lost`` with the detection path and how long detection took.

Lifecycle: ``STANDBY -> LEADING -> STANDBY ... -> STOPPED``; every transition
goes through ``_set_state``. Leadership listeners (:meth:`Coordinator.add_leadership_listener`)
hear when it starts leading (with its term) and when it stops (with the reason), on
every path: a step-down on :class:`NotLeader` and :meth:`Coordinator.stop`. The job
service (``service/jobs.py``, ``service/adoption.py``) adopts the jobs of a lost leader on
the first and hands its own jobs off on the second.
"""

from __future__ import annotations

import enum
import json
import queue
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from tenacity import RetryCallState

from rallypoint.basics.clock import SYSTEM_CLOCK, Clock
from rallypoint.orchestrator.control.devices import fence_worker, free_worker
from rallypoint.orchestrator.control.election import LeaderElection
from rallypoint.basics.errors import ConfigError, Fenced, NotLeader, StoreError
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from rallypoint.etcd.keys import Keys, check_name
from rallypoint.basics.logs import get_logger
from rallypoint.basics.retry import retrying
from rallypoint.orchestrator.control.membership import MembershipChange, MembershipMonitor
from rallypoint.orchestrator.service.links import WorkerLink
from rallypoint.orchestrator.service.silence import SilenceWatch
from rallypoint.orchestrator.observe.metrics import CoordinatorMetrics
from rallypoint.etcd.cluster_view import WorkerInfo
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.store import Put, Store
from rallypoint.basics import authz
from rallypoint.basics.tls import TlsConfig, add_port


class CoordinatorState(enum.Enum):
    STANDBY = "standby"
    LEADING = "leading"
    STOPPED = "stopped"

    @property
    def is_terminal(self) -> bool:
        return self is CoordinatorState.STOPPED


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """Settings of one coordinator.

    Attributes:
        cluster: cluster name.
        coordinator_id: this coordinator's id.
        endpoints: etcd client endpoints.
        lease_ttl_s: leader lease TTL (a dead leader is replaced within about this).
        attach_interval_s: heartbeat period asked of workers on Attach streams.
        suspect_after_s: a worker whose Attach stream has been silent this long (hung,
            partitioned, its host frozen) is suspected and fenced at once, well before its
            lease TTL runs out; 0 leaves hangs to the TTL. Fencing first keeps this safe: a
            worker that was only slow comes back as a new incarnation.
        campaign_interval_s: how often a standby tries to take the lead.
        host, port: where the coordinator's gRPC service (job submission) listens; port 0
            picks a free one. The leader publishes the address in the leader key.
        checkpoint_dir: where jobs keep checkpoints when they name no directory
            (a filesystem every worker shares; "": such jobs run without checkpoints).
        keep_runs: when a new run of a job name starts, keep this many of the name's earlier
            runs (their commits, records and files) and delete older ones (0: keep all; docs/operations.md).
        keep_history_s: how long an ended run (succeeded, failed, cancelled; an earlier run) stays in etcd
            for ``rallypoint jobs`` after its end; then the leader removes its record and commits from etcd (its
            files stay; 0: keep for ever; orchestrator/service/verbs.py).
        hooks: fault hooks for tests (:class:`ExecutorHooks`); the defaults break nothing.
        tls: this coordinator's certificate, key and CA: mutual TLS on its gRPC service, its
            channels to workers (executors take it from the store) and etcd (None: ``--insecure``).
        metrics_port: serve Prometheus metrics on ``host`` at this port (0: a free one; None: no
            endpoint). The address is logged (``metrics.serving``) and published in the
            coordinator's etcd record and the leader key (docs/metrics.md).
        max_watchers: ``WatchJob`` streams served at once; one more is refused with
            RESOURCE_EXHAUSTED. The gRPC server has a thread for each of them plus
            :data:`RPC_THREADS_RESERVED` that watchers never take (submissions, resumes, the
            rest), so watchers cannot starve the service (docs/control-plane.md).
    """

    cluster: str
    coordinator_id: str
    endpoints: tuple[str, ...]
    lease_ttl_s: int = 2
    attach_interval_s: float = 0.1
    suspect_after_s: float = 1.0
    campaign_interval_s: float = 0.25
    host: str = "127.0.0.1"
    port: int = 0
    checkpoint_dir: str = ""
    keep_runs: int = 0
    keep_history_s: float = 7 * 86400.0
    hooks: ExecutorHooks = field(default_factory=ExecutorHooks)
    tls: TlsConfig | None = None
    metrics_port: int | None = None
    max_watchers: int = 128

    def __post_init__(self) -> None:
        check_name("coordinator", self.coordinator_id)
        if self.max_watchers < 1:
            raise ConfigError(f"max_watchers must be >= 1, got {self.max_watchers}")
        if self.keep_history_s < 0:
            raise ConfigError(f"keep_history_s must be >= 0 (0: keep for ever), got {self.keep_history_s:g}")
        if self.keep_runs < 0:
            raise ConfigError(f"keep_runs must be >= 0 (0: keep every earlier run), got {self.keep_runs}")
        if self.lease_ttl_s < 1:
            raise ConfigError(f"lease_ttl_s must be >= 1, got {self.lease_ttl_s}")
        if not self.endpoints:
            raise ConfigError("no etcd endpoints: pass --cluster HOST:PORT")
        if self.suspect_after_s and self.suspect_after_s < 3 * self.attach_interval_s:
            raise ConfigError(f"suspect_after_s ({self.suspect_after_s:g}) must be 0 (off) or at least three heartbeat "
                              f"periods ({3 * self.attach_interval_s:g} s): a late heartbeat is not a hang")


RPC_THREADS_RESERVED = 32  # gRPC threads WatchJob streams never take: SubmitJob, ResumeJob, the other calls
SUBMIT_MAX_BYTES = 256 * 2**20  # the largest request the coordinator takes: a JobSpec with its programs and code
STEP_BACKOFF_S = 0.2  # etcd unreachable: the coordinator loop tries again after 0.2 s, 0.4 s, ... up to 1 s
STEP_BACKOFF_MAX_S = 1.0


class Coordinator:
    """One coordinator process's logic (see the module docstring)."""

    def __init__(self, config: CoordinatorConfig, *, store: Store | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.keys = Keys(config.cluster)
        self.store = store or EtcdStore(config.endpoints, tls=config.tls)
        self.clock = clock
        # Every RPC of the sync server holds a thread while it runs (a stream: until it ends). Watch
        # streams are capped below the pool (service/jobs.py), so RPC_THREADS_RESERVED threads always remain
        # for the other calls; past the pool, a call is refused (RESOURCE_EXHAUSTED) instead of queued.
        threads = config.max_watchers + RPC_THREADS_RESERVED
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="coordinator-rpc"),
                                  maximum_concurrent_rpcs=threads,
                                  # a submit carries the exported programs and the code bundle (client/bundle.py)
                                  options=[("grpc.max_receive_message_length", SUBMIT_MAX_BYTES)],
                                  interceptors=authz.interceptors(config.tls))  # each method checks the caller's role
        port = add_port(self.server, f"{config.host}:{config.port}", config.tls)
        if port == 0:
            raise ConfigError(f"cannot bind the coordinator gRPC server to {config.host}:{config.port}")
        self.address = f"{config.host}:{port}"
        self.metrics = (CoordinatorMetrics(self, host=config.host, port=config.metrics_port)
                        if config.metrics_port is not None else None)
        self.election = LeaderElection(
            self.store, self.keys, config.coordinator_id, ttl_s=config.lease_ttl_s, clock=clock, address=self.address,
            metrics_address=self.metrics.address if self.metrics else "",
        )
        self.state = CoordinatorState.STANDBY
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._links: dict[str, WorkerLink] = {}
        self._revoked: dict[tuple[str, int], tuple[str, float]] = {}
        self.monitor: MembershipMonitor | None = None
        self._confirmed_at = float("-inf")
        self._listeners: list[tuple[Callable[[int], None], Callable[[str], None]]] = []
        self._fence_listeners: list[Callable[[str, int, str], None]] = []
        self.silence = (SilenceWatch(config.suspect_after_s, config.attach_interval_s, clock)
                        if config.suspect_after_s else None)
        self.log = get_logger("rallypoint.coordinator", cluster=config.cluster, coordinator=config.coordinator_id)
        if self.metrics is not None:
            self.log.info("metrics.serving", address=self.metrics.address, url=self.metrics.server.url)

    def link(self, info: WorkerInfo, term: int) -> WorkerLink:
        """A link (not started) to worker ``info`` under ``term``; it reports a lost worker to :meth:`suspect`."""
        return WorkerLink(info, term, cluster=self.keys.cluster, coordinator_id=self.config.coordinator_id,
                          interval_s=self.config.attach_interval_s, tls=self.config.tls, clock=self.clock,
                          suspect=self.suspect)

    def _set_state(self, new: CoordinatorState, **fields: Any) -> None:
        old, self.state = self.state, new
        if old is not new:
            self.log.info("coordinator.state", previous=old.value, state=new.value, **fields)

    # -- leadership listeners ---------------------------------------------------------

    def add_leadership_listener(self, on_lead: Callable[[int], None], on_step_down: Callable[[str], None]) -> None:
        """Call ``on_lead(term)`` when this coordinator starts leading and ``on_step_down(reason)``
        when it stops (deposed, its lease deadline passed, its membership watch failed, or
        :meth:`stop`).

        Both run on the coordinator thread, so they should return soon; an exception in
        one is logged (``coordinator.listener_failed``) and changes nothing else.
        """
        self._listeners.append((on_lead, on_step_down))

    def add_fence_listener(self, on_fenced: Callable[[str, int, str], None]) -> None:
        """Call ``on_fenced(worker, incarnation, reason)`` as soon as this leader has revoked a
        worker's lease (a lost connection), or has found it silent (before the revoke: the executors'
        recoveries fence it themselves), before etcd's watch reports the registration gone: the executors
        start their recoveries without waiting for their next registration check. It runs
        on the coordinator thread; an exception is logged and changes nothing else."""
        self._fence_listeners.append(on_fenced)

    def _notify(self, which: str, arg: Any) -> None:
        for on_lead, on_step_down in list(self._listeners):
            try:
                if which == "lead":
                    on_lead(arg)
                else:
                    on_step_down(arg)
            except Exception as exc:
                self.log.exception("coordinator.listener_failed", listener=which, error=repr(exc))

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (the coordinator is going away, not only standing by)."""
        return self._stop.is_set()

    # -- inputs from other threads ------------------------------------------------

    def suspect(self, info: WorkerInfo, *, reason: str, detail: str = "") -> None:
        """A link saw the worker's process go away (called from link threads)."""
        self._events.put(("suspect", (info, reason, detail, self.clock.monotonic())))

    def _on_change(self, change: MembershipChange) -> None:
        self._events.put(("change", change))

    def _on_monitor_failure(self, exc: BaseException) -> None:
        self._events.put(("monitor_failed", exc))

    # -- leading -------------------------------------------------------------------------

    def _start_leading(self) -> None:
        term = self.election.term
        self._set_state(CoordinatorState.LEADING, term=term)
        self.monitor = MembershipMonitor(
            self.store,
            self.keys,
            self._on_change,
            should_run=lambda: self.election.term == term,
            on_failure=self._on_monitor_failure,
            clock=self.clock,
        )
        self.monitor.start()
        self._notify("lead", term)

    def _stop_leading(self, reason: str) -> None:
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        for link in self._links.values():
            link.stop()
        self._links.clear()
        while not self._events.empty():
            self._events.get_nowait()
        if self.state is CoordinatorState.LEADING:
            self._set_state(CoordinatorState.STANDBY, reason=reason)
            self._notify("step_down", reason)

    def _handle_change(self, change: MembershipChange) -> None:
        info = change.info
        term = self.election.term
        assert term is not None
        if change.kind == "registered":
            self.log.info("worker.joined", worker=info.worker, incarnation=info.incarnation, address=info.address)
            old = self._links.pop(info.worker, None)
            if old is not None:
                old.stop()
            link = self.link(info, term)
            self._links[info.worker] = link
            link.start()
        elif change.kind in ("lost", "left"):
            link = self._links.get(info.worker)
            if link is not None and link.info.incarnation == info.incarnation:
                self._links.pop(info.worker).stop()
            # Its device leases hang on the leader's lease, not its own: the leader frees them (control/devices.py).
            freed = free_worker(self.store, self.keys, self.election.fenced_txn, info.worker, change.revision)
            if change.kind == "left":
                self.log.info("worker.left", worker=info.worker, incarnation=info.incarnation, freed=freed)
                return
            revoked = self._revoked.get((info.worker, info.incarnation))
            reason, suspected_at = revoked if revoked else ("lease_expired", None)
            record = {
                "worker": info.worker,
                "incarnation": info.incarnation,
                "reason": reason,
                "pid": info.pid,
                "address": info.address,
                "revision": change.revision,
                "term": term,
                "at": self.clock.wall(),
            }
            self.election.fenced_txn([], [Put(self.keys.lost(info.worker), json.dumps(record))])
            self._revoked.pop((info.worker, info.incarnation), None)
            fields: dict[str, Any] = {}
            if suspected_at is not None:
                fields["fence_s"] = round(self.clock.monotonic() - suspected_at, 4)
            self.log.warning(
                "worker.lost",
                worker=info.worker,
                incarnation=info.incarnation,
                reason=reason,
                lease=f"{info.lease:x}",
                revision=change.revision,
                **fields,
            )

    def _handle_suspect(self, info: WorkerInfo, reason: str, detail: str, at: float, told: bool = False) -> None:
        """Fence a worker whose process is gone: revoke its lease if it is still that incarnation; then tell the
        fence listeners, unless they were ``told`` already (a silent worker: :meth:`_check_silence`)."""
        self.election.check()
        self._revoked[(info.worker, info.incarnation)] = (reason, at)
        lease = fence_worker(self.store, self.keys, self.election.fenced_txn, info.worker, info.incarnation)
        if lease is None:
            self._revoked.pop((info.worker, info.incarnation), None)
            return  # already gone (lease expired first) or re-registered
        self.log.warning(
            "lease.revoked", worker=info.worker, incarnation=info.incarnation, lease=f"{lease:x}",
            reason=reason, detail=detail, fence_s=round(self.clock.monotonic() - at, 4),
        )
        if not told:
            self._tell_fenced(info, f"{reason}: {detail}" if detail else reason)

    def _tell_fenced(self, info: WorkerInfo, reason: str) -> None:
        for on_fenced in list(self._fence_listeners):
            try:
                on_fenced(info.worker, info.incarnation, reason)
            except Exception as exc:
                self.log.exception("coordinator.listener_failed", listener="fenced", error=repr(exc))

    def _check_silence(self) -> None:
        """Suspect every worker whose Attach stream has been silent for ``suspect_after_s``, pauses of this
        process set aside (:mod:`~rallypoint.orchestrator.service.silence`). The jobs on it are told at once
        (their recoveries fence it too); the leader's own fence follows on this loop."""
        if self.silence is None:
            return
        for link, quiet in self.silence.silent(list(self._links.values())):
            link.suspected = True
            limit = self.config.suspect_after_s
            self.log.warning("worker.silent", worker=link.info.worker, incarnation=link.info.incarnation,
                             silent_s=round(quiet, 3), limit_s=limit)
            detail = f"no heartbeat for {quiet:.2f}s (suspect_after_s {limit:g})"
            self._tell_fenced(link.info, f"silent: {detail}")
            self._events.put(("suspect", (link.info, "silent", detail, self.clock.monotonic(), True)))

    def lead_step(self, timeout_s: float = 0.25) -> None:
        """One iteration of the leader loop: look for silent workers, handle one event, or confirm the term."""
        self._check_silence()
        if self.silence is not None:  # a silent worker is looked at within a heartbeat period of its limit
            timeout_s = min(timeout_s, self.config.attach_interval_s)
        try:
            kind, payload = self._events.get(timeout=timeout_s)
        except queue.Empty:
            # The local deadline is checked on every iteration; a round trip to etcd
            # (which also catches a leader key deleted by hand) every third of a TTL.
            if self.clock.monotonic() - self._confirmed_at >= self.config.lease_ttl_s / 3:
                self.election.confirm()
                self._confirmed_at = self.clock.monotonic()
            else:
                self.election.check()
            return
        if kind == "monitor_failed":
            raise NotLeader(f"coordinator {self.config.coordinator_id}", f"membership watch failed: {payload}")
        try:
            if kind == "change":
                self._handle_change(payload)
            else:
                self._handle_suspect(*payload)
        except StoreError:
            self._events.put((kind, payload))  # etcd unreachable: handle it again later
            raise

    # -- main loop -------------------------------------------------------------------------

    def step(self) -> None:
        """One iteration: campaign when standing by, serve events when leading."""
        if self.state is CoordinatorState.STANDBY:
            try:
                leads = self.election.try_acquire()
            except Fenced:
                leads = False  # our own lease is not renewed right now (etcd unreachable): wait
            if leads:
                self._start_leading()
            else:
                self.clock.wait(self._stop, self.config.campaign_interval_s)
            return
        try:
            self.lead_step()
        except NotLeader as exc:
            # A refusal by etcd already stepped down. Otherwise keep the lease while it
            # may still live: if only the local deadline passed, we resume the same term.
            if self.election.term is not None:
                self.election.step_down(str(exc), keep_lease=None)
            self._stop_leading(str(exc))

    def _store_retry_logged(self, state: RetryCallState) -> None:
        n = state.attempt_number
        if n == 1 or n % 10 == 0:
            exc = state.outcome.exception() if state.outcome is not None else None
            self.log.warning("coordinator.store_unavailable", failures=n, error=str(exc))

    def _step_failed(self, exc: Exception) -> None:
        """An unexpected error on the coordinator thread: step down (its lease revoked, so the state
        it led with is dropped whole and a standby may take over), then campaign again."""
        reason = f"internal error on the coordinator thread: {exc!r}"
        self.log.exception("coordinator.step_failed", state=self.state.value, term=self.election.term,
                           error=repr(exc), action="step down, campaign again")
        try:
            self.election.step_down(reason)
        except Exception as err:  # noqa: BLE001 - stepping down must not end the thread either
            self.log.exception("coordinator.step_down_failed", error=repr(err))
        try:
            self._stop_leading(reason)
        except Exception as err:  # noqa: BLE001
            self.log.exception("coordinator.step_down_failed", error=repr(err))
            self.state = CoordinatorState.STANDBY
        self.clock.wait(self._stop, self.config.campaign_interval_s)

    def run(self) -> None:
        """Run until :meth:`stop`. etcd outages are retried (tenacity, on the injected clock), never fatal;
        any other error steps this coordinator down and it campaigns again (``coordinator.step_failed``)."""
        self.server.start()
        if self.silence is not None:
            threading.Thread(target=self.silence.run, args=(self._stop,), name="silence-ticker", daemon=True).start()
        step = retrying(clock=self.clock, what="coordinator step", retry_on=StoreError, should_stop=self._stop.is_set,
                        initial_s=STEP_BACKOFF_S, max_s=STEP_BACKOFF_MAX_S, before_sleep=self._store_retry_logged)
        while not self._stop.is_set():
            try:
                step(self.step)  # each call backs off afresh: a step that succeeds resets the backoff
            except StoreError:
                pass  # stop() came while etcd was away
            except Exception as exc:  # a bug, or an error nobody foresaw: never the end of this thread
                self._step_failed(exc)
        self._stop_leading("stopping")
        self.server.stop(grace=1.0)
        self.election.resign()
        if self.metrics is not None:
            self.metrics.close()
        self._set_state(CoordinatorState.STOPPED)

    def stop(self) -> None:
        self._stop.set()
