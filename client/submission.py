"""Submitting a compiled program to a cluster's leader coordinator and following it.

A job outlives its leader: when the leader dies or is deposed, the new leader adopts
the job, and :class:`JobFollower` follows it there (``WatchJob``).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from rallypoint.etcd.records import parsed
from rallypoint.client.compile import CompiledProgram, slice_mesh
from rallypoint.client.errors import ProgramError
from rallypoint.client.jobspec import job_spec
from rallypoint.client.reference import RunResult, state_digest
from rallypoint.basics.clock import SYSTEM_CLOCK
from rallypoint.basics.errors import RallypointError, StoreError
from rallypoint.etcd.keys import Keys
from rallypoint.basics.retry import retrying
from rallypoint.etcd.etcd_store import CLIENT_CONNECT_WAIT_S, EtcdStore
from rallypoint.orchestrator.api import END_EVENTS
from rallypoint.basics.tls import channel as tls_channel
from rallypoint.basics.tls import tls_of
from rallypoint.proto import codec
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc


class JobError(RallypointError):
    """The job failed on the cluster; the message is the coordinator's reason."""


class JobStoppedError(JobError):
    """The job was suspended or cancelled (``state``) before it finished; the message says by whom and how to
    go on."""

    def __init__(self, state: str, message: str, *, resumes_by_itself: bool = False) -> None:
        super().__init__(message)
        self.state = state
        self.resumes_by_itself = resumes_by_itself  # suspended for a higher-priority job: the leader resumes it


FOLLOW_S = 120.0
"""How long a client looks for its job on a new leader after losing the old one."""
ETCD_WAIT_S = 15.0
"""How long a client that lost its leader waits for etcd itself before it gives up (the cluster may be gone)."""
OPEN_WAIT_S = 15.0
"""How long the first call waits for a leader (one that just died refuses connections until its key expires)."""
SILENT_SWITCH_S = 1.0
"""A stream silent this long while another term leads comes from a hung, deposed leader: switch."""


RECOVERY_SUMMARY = ("failures", "recoveries", "replayed_instances", "redone_s", "compute_s", "output_log_peak",
                    "corrupt_checkpoints", "stalls", "drains", "resharded", "exact", "tolerance",
                    "nondeterministic_workers", "stragglers", "final_cut_s", "window", "rollbacks")


def submit(
    compiled: CompiledProgram, *, endpoints: Sequence[str], cluster: str, window: int = 0,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    on_event: Callable[[pb.JobEvent], None] | None = None, follow_s: float = FOLLOW_S, new_run: bool = False,
    code_dir: str | None = None, final_state: str = "sharded", **recovery: Any,
) -> RunResult:
    """Run ``compiled`` on the cluster; return its final state and digest.

    The job is followed through leader changes (:class:`JobFollower`): a new leader adopts
    it, and ``follow_s`` bounds how long the client looks for it after losing its leader.
    ``recovery``: the job's recovery settings (:data:`rallypoint.client.jobspec.RECOVERY_FIELDS`).
    ``new_run``: the job name has a run with commits: start a new run (the old one is kept under
    its run id) instead of being refused (docs/operations.md, "Runs").
    ``code_dir``: the directory shipped as the job's code bundle (default: the job file's, when
    the program has host sources; docs/data.md).
    ``tensorboard=DIR``, ``wandb=DIR`` (in ``recovery``'s keywords): trackers the leading coordinator also writes
    the job's metrics and marks to (:func:`rallypoint.client.jobspec.job_spec`; docs/metrics.md, "Trackers").
    ``final_state``: ``"sharded"``: a sharded state comes back laid out as it was, over this process's
    devices of its slice's mesh (host arrays when this process has too few); ``"host"``: every state
    as host arrays. A replicated state is host arrays either way.

    Raises:
        JobError: the job failed (the reason names what went wrong).
        ValueError: ``final_state`` is neither ``"sharded"`` nor ``"host"`` (before anything is submitted).
    """
    if final_state not in ("sharded", "host"):
        raise ValueError(f"final_state must be 'sharded' or 'host', got {final_state!r}")
    spec = job_spec(compiled, window=window, code_dir=code_dir, **recovery)
    spec.new_run = new_run
    spec.submit_id = uuid.uuid4().hex  # a retried submit follows the run this one started (service.py)
    t0 = time.perf_counter()
    metrics_log: dict[int, dict[str, float]] = {}  # step -> its metrics (a rolled-back step's: the last run's)

    def step(s: int, metrics: dict[str, float]) -> None:
        metrics_log[s] = metrics
        if on_step is not None:
            on_step(s, metrics)

    ev = _follow(spec.job, endpoints, cluster, lambda stub: stub.SubmitJob(spec), on_step=step, on_event=on_event,
                 follow_s=follow_s)
    states = _states(compiled, ev.states)
    detail = json.loads(ev.detail or "{}")
    digest = state_digest(states)
    if detail.get("state_digest") and detail["state_digest"] != digest:
        raise JobError(f"job {spec.job!r}: the coordinator's state digest {detail['state_digest']} differs "
                       f"from the one of the states it sent ({digest})")
    if final_state == "sharded":
        states = _laid_out(compiled, states)
    return RunResult(spec.job, spec.steps, states, digest, time.perf_counter() - t0,
                     [metrics_log[k] for k in sorted(metrics_log)],
                     recovery={k: detail[k] for k in RECOVERY_SUMMARY if k in detail})


def _laid_out(compiled: CompiledProgram, states: dict[str, Any]) -> dict[str, Any]:
    """Each sharded state laid out as it was on its slice, over this process's devices of the slice's mesh (as
    host arrays when this process has too few); the replicated ones as they are."""
    import jax

    out = dict(states)
    for name, value in states.items():
        cs = compiled.states[name]
        if not cs.sharded:
            continue
        try:
            mesh = slice_mesh(compiled.program, cs.slice)
        except ProgramError:
            continue
        shardings = [jax.sharding.NamedSharding(mesh, spec) for spec in cs.specs]
        out[name] = cs.tree.unflatten(jax.device_put(jax.tree_util.tree_leaves(value), shardings))
    return out


class JobFollower:
    """Follows one job's events to its end through leader changes.

    The first call (``SubmitJob`` or ``ResumeJob``) goes to the leader. When its stream
    ends with ``job.handed_off`` (the leader's term ended), breaks (the leader died), or
    stays silent while another term leads (the leader hangs), the follower finds the
    leader again through etcd and calls ``WatchJob`` there, until ``job.finished`` or
    ``job.failed``, or for ``follow_s`` after the stream was lost.

    ``on_event`` receives every event as it comes (events may repeat across a switch:
    ``step.done`` of a step seen twice, or missed); ``on_step`` is called at most once
    per step, but again for the steps a rollback runs again (``job.rolled_back``: from its cut on). Thread-safe :meth:`cancel` ends :meth:`follow` with a :class:`JobError`.
    """

    def __init__(self, job: str, endpoints: Sequence[str], cluster: str, *,
                 on_event: Callable[[pb.JobEvent], None] | None = None,
                 on_step: Callable[[int, dict[str, float]], None] | None = None,
                 follow_s: float = FOLLOW_S, etcd_wait_s: float = ETCD_WAIT_S, open_wait_s: float = OPEN_WAIT_S,
                 silent_switch_s: float = SILENT_SWITCH_S,
                 until: Callable[[pb.JobEvent], bool] = lambda ev: ev.event in END_EVENTS) -> None:
        self.job, self.endpoints, self.cluster = job, list(endpoints), cluster
        self.until = until  # the event that ends the following (the job's end; a detached submit: its start too)
        self.on_event, self.on_step = on_event, on_step
        self.follow_s, self.etcd_wait_s, self.open_wait_s = follow_s, etcd_wait_s, open_wait_s
        self.silent_switch_s = silent_switch_s
        self.switches: list[dict[str, Any]] = []  # each time the job was followed to a leader again, and why
        self.address = ""  # the leader the current (or last) stream came from
        self._steps: set[int] = set()
        self._lock = threading.Lock()
        self._call: Any = None
        self._cancelled: str | None = None
        self._silent_switch: str | None = None
        self._last_event = time.monotonic()
        self._store: EtcdStore | None = None

    # -- control -----------------------------------------------------------------------------

    def cancel(self, reason: str) -> None:
        """End :meth:`follow` soon with ``JobError(reason)`` (from any thread)."""
        with self._lock:
            self._cancelled = reason
            call = self._call
        if call is not None:
            call.cancel()

    def _check_cancelled(self) -> None:
        if self._cancelled is not None:
            raise JobError(f"job {self.job!r}: {self._cancelled}")

    # -- following ------------------------------------------------------------------------------

    def follow(self, call: Callable[[Any], Iterator[pb.JobEvent]]) -> pb.JobEvent:
        """Open ``call`` on the leader and follow the job; return its ``job.finished`` or ``job.failed`` event.

        Raises:
            JobError: the leader refused the call, or the job was lost (no leader had it within
                ``follow_s``, or etcd stayed unreachable for ``etcd_wait_s``), or :meth:`cancel`.
        """
        watch: Callable[[Any], Iterator[pb.JobEvent]] = lambda stub: stub.WatchJob(  # noqa: E731
            pb.WatchJobRequest(job=self.job))
        self._store = EtcdStore(self.endpoints, connect_wait_s=CLIENT_CONNECT_WAIT_S)
        rpc, watching, why, lost_at = call, False, "", 0.0
        try:
            while True:
                deadline = lost_at + self.follow_s if watching else time.monotonic() + self.open_wait_s
                opened = self._open(rpc, deadline, watching=watching, why=why)
                if opened is None:
                    rpc, watching, lost_at = watch, True, time.monotonic()
                    why = "the leader was lost while the job was submitted, and the new leader runs it"
                    continue
                term, events, channel, stop = opened
                try:
                    end, why = self._read(events)
                finally:
                    self._end_watching(stop)
                    channel.close()
                if end is not None:
                    return end
                self._check_cancelled()
                lost_at = time.monotonic()
                self.switches.append({"at": time.time(), "from": self.address, "term": term, "why": why,
                                      "steps_seen": len(self._steps)})
                rpc, watching = watch, True
        finally:
            self._store.close()
            self._store = None

    def _leader(self, store: EtcdStore) -> tuple[str, int] | None:
        kv = store.get(Keys(self.cluster).leader)
        rec = parsed(kv, "leader")
        if kv is None or rec is None or not rec.get("address"):
            return None
        return str(rec["address"]), kv.create_revision

    def _open(self, rpc: Callable[[Any], Iterator[pb.JobEvent]], deadline: float, *, watching: bool,
              why: str) -> tuple[int, Iterator[pb.JobEvent], grpc.Channel, threading.Event] | None:
        """``rpc`` on the leader, once it answers with a first event: its term, the events, the
        channel, and the event that stops the thread watching for a hung leader (set it when done).
        None: a submission retried on a new leader found the job running there (it adopted it).

        Retried (tenacity, bounded backoff) while there is no leader yet, etcd is briefly away,
        or the leader in etcd refuses connections or no longer leads, up to ``deadline``.
        """
        lost = f"{why}; " if why else ""
        st: dict[str, Any] = {"last": "no leader in etcd yet", "etcd_down_since": None, "refused_unavailable": False}

        def attempt() -> tuple[int, Iterator[pb.JobEvent], grpc.Channel, threading.Event] | str | None:
            """The opened stream; "resubmitted"; or None: not yet, try again."""
            self._check_cancelled()
            now = time.monotonic()
            try:
                assert self._store is not None
                leader = self._leader(self._store)
                st["etcd_down_since"] = None
            except StoreError as exc:
                st["etcd_down_since"] = st["etcd_down_since"] or now
                st["last"] = f"etcd unreachable: {exc}"
                if now - st["etcd_down_since"] > self.etcd_wait_s:
                    raise JobError(f"job {self.job!r}: {lost}etcd stayed unreachable for {self.etcd_wait_s:.0f}s "
                                   f"({exc}); once the cluster is back, `rallypoint status {self.job}` shows the job "
                                   f"and `rallypoint resume {self.job}` restarts it") from None
                return None
            if leader is None:
                return None
            address, term = leader
            channel = tls_channel(  # the identity the store reaches etcd with
                address, tls_of(self._store),
                options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
            stream = rpc(pb_grpc.CoordinatorStub(channel))
            with self._lock:
                self._call = stream
                if self._cancelled is not None:
                    stream.cancel()
            self.address = address
            self._last_event = time.monotonic()
            stop = self._start_watching(term)
            try:
                first = next(stream)
            except StopIteration:
                self._end_watching(stop)
                channel.close()
                st["last"] = f"the coordinator at {address} closed the stream at once"
                return None
            except grpc.RpcError as exc:
                self._end_watching(stop)
                channel.close()
                self._check_cancelled()
                if self._silent_switch is not None:
                    st["last"], self._silent_switch = self._silent_switch, None
                    return None
                code = exc.code()
                st["last"] = f"the coordinator at {address} answered {code.name}: {exc.details()}"
                if code == grpc.StatusCode.UNAVAILABLE or (watching and code == grpc.StatusCode.FAILED_PRECONDITION):
                    # a dead leader still in the key, or leadership moving: ask etcd again
                    st["refused_unavailable"] = st["refused_unavailable"] or code == grpc.StatusCode.UNAVAILABLE
                    return None
                if not watching and code == grpc.StatusCode.ALREADY_EXISTS and st["refused_unavailable"]:
                    return "resubmitted"
                raise JobError(f"job {self.job!r}: {lost}{st['last']}") from None
            return term, itertools.chain([first], stream), channel, stop

        opened = retrying(clock=SYSTEM_CLOCK, what=f"following job {self.job}", retry_if_result=lambda r: r is None,
                          stop_after_s=max(0.0, deadline - time.monotonic()), initial_s=0.2, max_s=0.5,
                          jitter_s=0.05)(attempt)
        if opened is None:
            raise JobError(f"job {self.job!r}: {lost}no leader answered for it within "
                           f"{self.follow_s if watching else self.open_wait_s:.0f}s (last: {st['last']})")
        return None if opened == "resubmitted" else opened

    def _start_watching(self, term: int) -> threading.Event:
        self._silent_switch = None
        stop = threading.Event()
        threading.Thread(target=self._watch_leader, args=(term, stop), name="job-follower", daemon=True).start()
        return stop

    def _end_watching(self, stop: threading.Event) -> None:
        with self._lock:  # after this, that watcher cancels nothing (it checks under the same lock)
            stop.set()
            self._call = None

    def _read(self, events: Iterator[pb.JobEvent]) -> tuple[pb.JobEvent | None, str]:
        """The stream's events until the job's end (returned) or until it is lost (None, and why)."""
        try:
            for ev in events:
                self._last_event = time.monotonic()
                if self.on_event is not None:
                    self.on_event(ev)
                if ev.event == "step.done":
                    if ev.step not in self._steps:
                        self._steps.add(int(ev.step))
                        if self.on_step is not None:
                            self.on_step(int(ev.step), dict(ev.metrics))
                elif ev.event == "job.rolled_back":  # the steps from its cut run again, on other batches
                    cut = int(json.loads(ev.detail or "{}").get("cut", ev.step))
                    self._steps = {s for s in self._steps if s < cut}
                elif self.until(ev):
                    return ev, ""
                elif ev.event == "job.handed_off":
                    reason = json.loads(ev.detail or "{}").get("reason", "")
                    return None, f"the leader at {self.address} handed the job off ({reason})"
            return None, f"the leader at {self.address} closed the stream before the job ended"
        except grpc.RpcError as exc:
            self._check_cancelled()
            if self._silent_switch is not None:
                return None, self._silent_switch
            return None, f"the stream from the leader at {self.address} broke ({exc.code().name}: {exc.details()})"

    def _watch_leader(self, term: int, stop: threading.Event) -> None:
        """Cancel the stream when another term leads and the stream has been silent: its leader hangs."""
        store, address = self._store, self.address
        while store is not None and not stop.wait(0.5):
            try:
                leader = self._leader(store)
            except (StoreError, ValueError):  # etcd away, or the follower closed its store
                continue
            if leader is None or leader[1] == term or time.monotonic() - self._last_event <= self.silent_switch_s:
                continue
            with self._lock:
                if stop.is_set():
                    return
                self._silent_switch = f"the leader at {address} (term {term}) went silent and term {leader[1]} leads now"
                call = self._call
            if call is not None:
                call.cancel()
            return


def _follow(job: str, endpoints: Sequence[str], cluster: str, call: Callable[[Any], Iterator[pb.JobEvent]], *,
            on_step: Callable[[int, dict[str, float]], None] | None,
            on_event: Callable[[pb.JobEvent], None] | None, follow_s: float = FOLLOW_S) -> pb.JobEvent:
    """Follow a job's events from the leader, through leader changes, to its ``job.finished`` event.

    Raises:
        JobError: the job failed, or it was lost (see :class:`JobFollower`).
    """
    ev = JobFollower(job, endpoints, cluster, on_event=on_event, on_step=on_step, follow_s=follow_s).follow(call)
    ended(ev)
    return ev


def ended(ev: pb.JobEvent) -> None:
    """Raise for a job's end that is not its finish.

    Raises:
        JobError: ``job.failed`` (with the coordinator's reason).
        JobStoppedError: ``job.suspended`` or ``job.cancelled`` (by whom, and how to go on).
    """
    detail = json.loads(ev.detail or "{}")
    reason = detail.get("reason", "unknown")
    if ev.event == "job.failed":
        raise JobError(f"job {ev.job!r} failed: {reason}")
    if ev.event in ("job.suspended", "job.cancelled"):
        state = ev.event.removeprefix("job.")
        auto = state == "suspended" and bool((detail.get("stop") or {}).get("auto_resume"))
        then = (f"the leader resumes it by itself once room returns (`rallypoint watch {ev.job}` follows it)"
                if auto else f"its run is kept: `rallypoint resume {ev.job}` continues it")
        raise JobStoppedError(state, f"{reason}; {then}", resumes_by_itself=auto)


def _states(compiled: CompiledProgram, values: Sequence[pb.StateValue]) -> dict[str, Any]:
    states = {}
    for v in values:
        cs = compiled.states[v.state]
        states[v.state] = cs.tree.unflatten([codec.from_tensor(t) for t in v.leaves])
    missing = set(compiled.states) - set(states)
    if missing:
        raise JobError(f"the final state lacks {sorted(missing)}")
    return states


def resume(
    job: str, *, endpoints: Sequence[str], cluster: str, checkpoint_dir: str = "",
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    on_event: Callable[[pb.JobEvent], None] | None = None, follow_s: float = FOLLOW_S,
) -> dict[str, Any]:
    """Resume ``job`` from its newest consistent cut; return its ``job.finished`` detail
    (``state_digest`` computed by the coordinator, ``start_step``, the recovery summary).
    Followed through leader changes like :func:`submit`.

    Raises:
        JobError: the job could not be resumed or failed.
    """
    ev = _follow(job, endpoints, cluster,
                 lambda stub: stub.ResumeJob(pb.ResumeRequest(job=job, checkpoint_dir=checkpoint_dir)),
                 on_step=on_step, on_event=on_event, follow_s=follow_s)
    return {"job": job, "steps": int(ev.step), **json.loads(ev.detail or "{}")}
