"""The graph executor: runs one job on the cluster, from the leader.

It places every virtual slice on a worker's devices (device leases, fenced on the
leader's term), records the placement in etcd, loads each worker with the exported
programs of its slices and its routes, and then only **grants steps**: workers run
instances as their inputs arrive and push outputs straight to each other, and a
bounded window of steps is in flight. The executor hears completions (and the
scalar metrics), never tensors, until it fetches the final state.

Lifecycle (one state machine, every transition through ``_set_state``)::

    PLACING -> LOADING -> RUNNING -> FINISHING -> SUCCEEDED
        \\_________\\___________\\__________\\____-> FAILED (with a reason)
"""

from __future__ import annotations

import enum
import json
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from orchestrator.clock import SYSTEM_CLOCK, Clock
from orchestrator.devices import DeviceLeases, read_cluster
from orchestrator.election import LeaderElection
from orchestrator.errors import AllocationError, NotLeader, RallypointError, StoreError
from orchestrator.keys import Keys
from orchestrator.logs import get_logger
from orchestrator.placement import SlicePlace, instances_per_step, load_requests
from orchestrator.store import Put, Store
from proto import rallypoint_pb2 as pb
from proto import rallypoint_pb2_grpc as pb_grpc

LOAD_TIMEOUT_S = 300.0
FETCH_TIMEOUT_S = 300.0


class JobState(enum.Enum):
    PLACING = "placing"
    LOADING = "loading"
    RUNNING = "running"
    FINISHING = "finishing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED)


class JobFailed(RallypointError):
    """The job cannot go on; the message is the reason recorded and reported."""


class JobExecutor:
    """Runs one submitted job to its end; reports through ``emit``.

    Args:
        spec: the job, as the client submitted it.
        store: the coordination store.
        keys: the cluster's key schema.
        election: the leader's election (its term fences every write).
        emit: receives each :class:`pb.JobEvent` (``job.placed``, ``step.done``,
            ``job.finished``, ``job.failed``).
    """

    def __init__(self, spec: pb.JobSpec, *, store: Store, keys: Keys, election: LeaderElection,
                 emit: Callable[[pb.JobEvent], None], clock: Clock = SYSTEM_CLOCK) -> None:
        self.spec = spec
        self.store = store
        self.keys = keys
        self.election = election
        self.emit = emit
        self.clock = clock
        self.state = JobState.PLACING
        self.placement: dict[str, SlicePlace] = {}
        self.step_done = 0  # steps finished on every worker
        self.term = election.term or 0
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.WorkerRuntimeStub] = {}
        self._identities: dict[str, pb.Identity] = {}
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: list[Any] = []
        self.log = get_logger("rallypoint.executor", cluster=keys.cluster, job=spec.job, term=self.term)

    # -- state ----------------------------------------------------------------------

    def _set_state(self, new: JobState, **fields: Any) -> None:
        old, self.state = self.state, new
        self.log.info("job.state", previous=old.value, state=new.value, **fields)
        self._record(**fields)

    def _record(self, **fields: Any) -> None:
        record = {
            "job": self.spec.job, "state": self.state.value, "steps": self.spec.steps, "step_done": self.step_done,
            "term": self.term,
            "placement": {s: {"worker": p.worker, "devices": list(p.devices)} for s, p in self.placement.items()},
            "at": time.time(), **fields,
        }
        self.election.fenced_txn([], [Put(self.keys.job(self.spec.job), json.dumps(record))])

    # -- phases ------------------------------------------------------------------------

    def _place(self) -> None:
        leases = DeviceLeases(self.store, self.keys, fenced_txn=self.election.fenced_txn, term=self.term)
        for s in self.spec.slices:
            devices = int(np.prod(s.mesh_shape)) if len(s.mesh_shape) else 1
            p = leases.allocate(self.spec.job, s.slice, devices)
            self.placement[s.slice] = SlicePlace(p.worker, "", p.incarnation, p.devices)
        snap = read_cluster(self.store, self.keys)
        for name, p in self.placement.items():
            w = snap.workers.get(p.worker)
            if w is None or w.info.incarnation != p.incarnation:
                raise JobFailed(f"worker {p.worker} holding slice {name!r} was lost while the job was being placed")
            self.placement[name] = SlicePlace(p.worker, w.info.address, p.incarnation, p.devices, w.info.data_address)
        detail = {s: {"worker": p.worker, "incarnation": p.incarnation, "devices": list(p.devices)}
                  for s, p in self.placement.items()}
        self.emit(pb.JobEvent(job=self.spec.job, event="job.placed", detail=json.dumps(detail)))

    def _load(self) -> None:
        requests = load_requests(self.spec, self.placement, cluster=self.keys.cluster, term=self.term)
        for worker, req in requests.items():
            address = next(p.address for p in self.placement.values() if p.worker == worker)
            self._channels[worker] = grpc.insecure_channel(
                address, options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
            )
            self._stubs[worker] = pb_grpc.WorkerRuntimeStub(self._channels[worker])
            self._identities[worker] = req.to
        with ThreadPoolExecutor(max_workers=max(1, len(requests))) as pool:
            futures = {w: pool.submit(self._stubs[w].LoadJob, req, timeout=LOAD_TIMEOUT_S) for w, req in requests.items()}
            for w, f in futures.items():
                try:
                    f.result()
                except grpc.RpcError as exc:
                    raise JobFailed(f"worker {w} could not load the job: {exc.code().name} {exc.details()}") from None
        for w in requests:
            t = threading.Thread(target=self._listen, args=(w,), name=f"events-{w}", daemon=True)
            t.start()

    def _listen(self, worker: str) -> None:
        try:
            stream = self._stubs[worker].JobEvents(pb.JobEventsRequest(to=self._identities[worker], job=self.spec.job))
            self._streams.append(stream)
            for done in stream:
                self._events.put(("done", (worker, done)))
            self._events.put(("ended", (worker, "stream ended")))
        except grpc.RpcError as exc:
            self._events.put(("ended", (worker, f"{exc.code().name} {exc.details()}")))

    def _grant(self, until: int) -> None:
        for w, stub in self._stubs.items():
            try:
                stub.RunSteps(pb.RunStepsRequest(to=self._identities[w], job=self.spec.job, until_step=until), timeout=10)
            except grpc.RpcError as exc:
                raise JobFailed(f"worker {w} is unreachable: {exc.code().name} {exc.details()}") from None

    def _run_steps(self) -> None:
        steps, window = self.spec.steps, max(1, self.spec.window)
        expected = [instances_per_step(self.spec, s) for s in range(steps)]
        done = [0] * steps
        metrics: dict[int, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
        completed = 0  # steps 0 .. completed-1 are done everywhere
        granted = min(window, steps)
        self._grant(granted)
        while completed < steps:
            self.election.check()
            try:
                kind, payload = self._events.get(timeout=1.0)
            except queue.Empty:
                self._check_workers(completed)  # a hung worker's stream stays open: ask etcd
                continue
            worker, item = payload
            if kind == "ended":
                raise JobFailed(
                    f"worker {worker} stopped reporting at step {completed} ({item}); it was probably lost. "
                    "Recovery onto a spare is not available yet: the job fails"
                )
            if item.error:
                raise JobFailed(f"node {item.node!r} failed at step {item.step} on worker {worker}: {item.error}")
            done[item.step] += 1
            for name, value in item.metrics.items():
                metrics[item.step][name].append((item.microbatch, value))
            while completed < steps and done[completed] == expected[completed]:
                step_metrics = {
                    name: float(np.mean([v for _, v in sorted(vals)])) for name, vals in metrics.pop(completed, {}).items()
                }
                self.emit(pb.JobEvent(job=self.spec.job, event="step.done", step=completed, metrics=step_metrics))
                completed += 1
                self.step_done = completed
                if completed % 10 == 0:
                    self._record()
            if completed + window > granted and granted < steps:
                granted = min(completed + window, steps)
                self._grant(granted)

    def _check_workers(self, step: int) -> None:
        """Fail the job if a worker holding one of its slices is no longer that incarnation."""
        for name, p in self.placement.items():
            kv = self.store.get(self.keys.worker(p.worker))
            if kv is None or kv.create_revision != p.incarnation:
                raise JobFailed(
                    f"worker {p.worker} holding slice {name!r} was lost at step {step} (incarnation "
                    f"{p.incarnation} is gone). Recovery onto a spare is not available yet: the job fails"
                )

    def _fetch(self) -> list[pb.StateValue]:
        states: list[pb.StateValue] = []
        for w, stub in self._stubs.items():
            try:
                states += list(stub.FetchState(pb.FetchStateRequest(to=self._identities[w], job=self.spec.job),
                                               timeout=FETCH_TIMEOUT_S))
            except grpc.RpcError as exc:
                raise JobFailed(f"could not fetch the final state from worker {w}: {exc.code().name}") from None
        return sorted(states, key=lambda s: s.state)

    def _cleanup(self) -> None:
        for w, stub in self._stubs.items():
            try:
                stub.UnloadJob(pb.UnloadJobRequest(to=self._identities[w], job=self.spec.job), timeout=10)
            except grpc.RpcError:
                self.log.warning("job.unload_failed", worker=w)
        for s in self._streams:
            s.cancel()
        for ch in self._channels.values():
            ch.close()
        try:
            DeviceLeases(self.store, self.keys, fenced_txn=self.election.fenced_txn, term=self.term).release(self.spec.job)
        except (StoreError, AllocationError, NotLeader) as exc:
            self.log.warning("job.release_failed", error=str(exc))

    # -- the whole run ----------------------------------------------------------------------

    def run(self) -> JobState:
        """Run the job to its end. Never raises: a failure is a ``job.failed`` event and state.

        The terminal event goes out last, after the devices are released and the final
        state is recorded in etcd, so a client that sees it sees a settled cluster.
        """
        t0 = self.clock.monotonic()
        terminal: pb.JobEvent
        try:
            self._set_state(JobState.PLACING)
            self._place()
            self._set_state(JobState.LOADING)
            self._load()
            self._set_state(JobState.RUNNING)
            self._run_steps()
            self._set_state(JobState.FINISHING)
            states = self._fetch()
            wall = self.clock.monotonic() - t0
            terminal = pb.JobEvent(job=self.spec.job, event="job.finished", step=self.spec.steps, states=states,
                                   detail=json.dumps({"wall_s": round(wall, 3)}))
            final, reason = JobState.SUCCEEDED, ""
        except (RallypointError, grpc.RpcError) as exc:
            reason = str(exc) if isinstance(exc, RallypointError) else f"{exc.code().name} {exc.details()}"
            self.log.error("job.failed", reason=reason)
            terminal = pb.JobEvent(job=self.spec.job, event="job.failed", detail=json.dumps({"reason": reason}))
            final = JobState.FAILED
        self._cleanup()
        try:
            self._set_state(final, **({"reason": reason} if reason else {}))
        except (StoreError, NotLeader) as exc:
            self.log.warning("job.record_failed", error=str(exc))
        self.emit(terminal)
        return final
