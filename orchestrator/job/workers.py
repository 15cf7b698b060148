"""The executor's side of the workers running one job: channels, RPCs, event streams.

Each worker that holds a slice of the job is loaded (``LoadJob``), granted steps
(``RunSteps``), rewired after a recovery (``Rewire``), asked for the final state
(``FetchState``) and unloaded. Rewires and fetches go to every worker at once, each
with a deadline that follows from the bytes it moves (:func:`transfer_deadline_s`):
a rewire's from the output log the worker last reported (what it may resend), a
fetch's from the bytes received so far (it is cut once no bytes come for the base
time). Its ``JobEvents`` stream is read by a thread that
puts ``(kind, (worker, generation, item))`` on one queue: ``"batch"`` for each
message (its ``InstanceDone``s, a list in order), ``"ended"`` once the stream broke. A worker's **generation** changes every
time it is (re)loaded or dropped, so the executor ignores whatever a runtime it
gave up on still says.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from rallypoint.basics.logs import get_logger
from rallypoint.basics.clock import SYSTEM_CLOCK, Clock
from rallypoint.basics.tls import KEEPALIVE, TlsConfig
from rallypoint.basics.tls import channel as tls_channel
from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.orchestrator.job.grants import StepGrant
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc

LOAD_TIMEOUT_S = 300.0
RPC_TIMEOUT_S = 10.0
TRANSFER_BASE_S = 60.0  # a rewire's or fetch's deadline: this much, plus its bytes at ...
TRANSFER_BYTES_PER_S = 25e6  # ... this bandwidth (conservative: a slow network, a worker spilling to disk)


def transfer_deadline_s(nbytes: int, *, base_s: float = TRANSFER_BASE_S,
                        bytes_per_s: float = TRANSFER_BYTES_PER_S) -> float:
    """How long a call that moves ``nbytes`` may take: ``base_s`` plus the bytes at ``bytes_per_s``."""
    return base_s + max(nbytes, 0) / bytes_per_s

Event = tuple[str, tuple[str, int, Any]]


class _Deadline(grpc.RpcError):
    """A call this side cut at its deadline (its code is DEADLINE_EXCEEDED)."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details


class JobWorkers:
    """The workers of one job, as the executor talks to them. ``clock`` (the executor's) reads the time the
    deadlines of the waits on their streams and calls are judged by."""

    def __init__(self, job: str, tls: TlsConfig | None = None, *, transfer_base_s: float = TRANSFER_BASE_S,
                 transfer_bytes_per_s: float = TRANSFER_BYTES_PER_S, clock: Clock = SYSTEM_CLOCK) -> None:
        if transfer_base_s <= 0 or transfer_bytes_per_s <= 0:
            raise ValueError(f"a transfer deadline needs a base > 0 s and a bandwidth > 0 bytes/s, got "
                             f"{transfer_base_s} s and {transfer_bytes_per_s} bytes/s")
        self.job = job
        self.tls = tls
        self.clock = clock
        self.transfer_base_s, self.transfer_bytes_per_s = transfer_base_s, transfer_bytes_per_s
        self.log_bytes: dict[str, int] = {}  # worker -> its output log's bytes (memory + spilled), last reported
        self.events: queue.Queue[Event] = queue.Queue()
        self._stubs: dict[str, pb_grpc.WorkerRuntimeStub] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._address: dict[str, str] = {}
        self.identity: dict[str, pb.Identity] = {}
        self.generation: dict[str, int] = {}
        self._streams: list[Any] = []
        self._gens = itertools.count(1)
        self.restore_tiers: dict[str, str] = {}  # slice -> "memory" | "disk": what the last load restored from
        self.program_sources: dict[str, str] = {}  # node -> "warm" | "cold": what the last load found compiled
        self._lock = threading.Lock()
        self.log = get_logger("rallypoint.executor", job=job)

    def __contains__(self, worker: object) -> bool:
        return worker in self.identity

    @property
    def workers(self) -> list[str]:
        return sorted(self.identity)

    def current(self, worker: str, generation: int) -> bool:
        """Whether an event of ``generation`` from ``worker`` is from the runtime in use."""
        return self.generation.get(worker) == generation

    def _stub(self, worker: str, address: str | None = None) -> pb_grpc.WorkerRuntimeStub:
        """The stub of ``worker`` (at ``address`` from now on, when given): one channel per address."""
        if address is not None:
            self._address[worker] = address
        address = self._address[worker]
        if address not in self._stubs:
            self._channels[address] = tls_channel(
                address, self.tls, worker=worker,  # the server must be this worker (its certificate names it)
                options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1), *KEEPALIVE])
            self._stubs[address] = pb_grpc.WorkerRuntimeStub(self._channels[address])
        return self._stubs[address]

    def load(self, requests: Mapping[str, pb.LoadJobRequest], addresses: Mapping[str, str]) -> dict[str, WorkerCallFailed]:
        """Load the job on each worker in parallel and follow its events. Returns the failures by worker."""
        failed: dict[str, WorkerCallFailed] = {}
        self.restore_tiers, self.program_sources = {}, {}
        with ThreadPoolExecutor(max_workers=max(1, len(requests))) as pool:
            futures = {w: pool.submit(self._stub(w, addresses[w]).LoadJob, req, timeout=LOAD_TIMEOUT_S)
                       for w, req in requests.items()}
            for w, f in futures.items():
                try:
                    self.restore_tiers.update(f.result().restore_tiers)
                    self.program_sources.update(f.result().program_sources)
                except grpc.RpcError as exc:
                    failed[w] = WorkerCallFailed.from_rpc_error(w, "LoadJob", exc)
        for w, req in requests.items():
            if w in failed:
                continue
            gen = next(self._gens)
            self.identity[w], self.generation[w] = req.to, gen
            threading.Thread(target=self._listen, args=(w, gen, req.to), name=f"events-{w}", daemon=True).start()
        return failed

    def _listen(self, worker: str, gen: int, to: pb.Identity) -> None:
        try:
            stream = self._stub(worker).JobEvents(pb.JobEventsRequest(to=to, job=self.job))
            with self._lock:
                self._streams.append(stream)
            for batch in stream:  # InstanceDoneBatch: every event the worker had ready, in order, handled in one pass
                for item in batch.done:
                    if not item.error:  # each event carries the output log's bytes as they are now
                        self.log_bytes[worker] = int(item.log_bytes) + int(item.log_spilled_bytes)
                self.events.put(("batch", (worker, gen, list(batch.done))))
            self.events.put(("ended", (worker, gen, "stream ended")))
        except grpc.RpcError as exc:
            self.events.put(("ended", (worker, gen, f"{exc.code().name} {exc.details()}")))

    def gather_ended(self, lost: dict[str, str], grace_s: float) -> None:
        """Other workers lost with those in ``lost``: their streams break within ``grace_s``; they join ``lost``.
        Every other event read meanwhile goes back on the queue, in order, ahead of anything newer."""
        deadline = self.clock.monotonic() + grace_s
        kept = []
        while (left := deadline - self.clock.monotonic()) > 0:
            try:
                kind, (worker, gen, item) = self.events.get(timeout=left)
            except queue.Empty:
                break
            if kind == "ended" and self.current(worker, gen):
                lost.setdefault(worker, f"event stream ended: {item}")
            else:
                kept.append((kind, (worker, gen, item)))
        for ev in kept:
            self.events.put(ev)

    def drop(self, worker: str) -> None:
        """Forget a worker (lost, or about to be reloaded): its events are ignored from now on."""
        self.identity.pop(worker, None)
        self.generation.pop(worker, None)

    def grant(self, grants: Iterable[StepGrant]) -> None:
        """Send each worker its grant (steps below ``until``, the cut, the step it saves at when held), as the
        job's :class:`~rallypoint.orchestrator.job.grants.Grants` said, without waiting: a worker that does not
        answer must not hold up the others. A failure arrives on the event queue as
        ``("grant_failed", (worker, generation, WorkerCallFailed))``."""
        for g in list(grants):
            w = g.worker
            gen = self.generation.get(w)
            req = pb.RunStepsRequest(to=self.identity[w], job=self.job, cut_step=g.cut, until_step=g.until,
                                     save_at=g.save_at)
            future = self._stub(w).RunSteps.future(req, timeout=RPC_TIMEOUT_S)

            def done(f: Any, w: str = w, gen: int | None = gen) -> None:
                exc = f.exception()
                if exc is not None and gen is not None:
                    self.events.put(("grant_failed", (w, gen, WorkerCallFailed.from_rpc_error(w, "RunSteps", exc))))

            future.add_done_callback(done)

    def deadline_s(self, nbytes: int) -> float:
        """The deadline of a call that moves ``nbytes`` (:func:`transfer_deadline_s` with this job's settings)."""
        return transfer_deadline_s(nbytes, base_s=self.transfer_base_s, bytes_per_s=self.transfer_bytes_per_s)

    def rewire_request(self, worker: str, routes: Iterable[pb.Route], resend_to: Iterable[str], from_step: int,
                       until: int, replica_targets: Iterable[pb.ReplicaPeer] = ()) -> pb.RewireRequest:
        return pb.RewireRequest(to=self.identity[worker], job=self.job, routes=list(routes),
                                resend_to=sorted(resend_to), from_step=from_step, until_step=until,
                                replica_targets=list(replica_targets))

    def rewire(self, worker: str, routes: Iterable[pb.Route], resend_to: Iterable[str], from_step: int,
               until: int, replica_targets: Iterable[pb.ReplicaPeer] = ()) -> pb.RewireResponse:
        """Raises :class:`WorkerCallFailed`."""
        req = self.rewire_request(worker, routes, resend_to, from_step, until, replica_targets)
        answers, failed = self.rewire_all({worker: req})
        if failed:
            raise failed[worker]
        return answers[worker]

    def rewire_all(self, requests: Mapping[str, pb.RewireRequest]
                   ) -> tuple[dict[str, pb.RewireResponse], dict[str, WorkerCallFailed]]:
        """Rewire every worker of ``requests`` at once; the answers and the failures, by worker.

        Each call's deadline follows from the bytes the worker may resend: its output log
        as it last reported it.
        """
        answers: dict[str, pb.RewireResponse] = {}
        failed: dict[str, WorkerCallFailed] = {}
        if not requests:
            return answers, failed
        with ThreadPoolExecutor(max_workers=len(requests), thread_name_prefix=f"rewire-{self.job}") as pool:
            futures = {w: pool.submit(self._stub(w).Rewire, req,
                                      timeout=self.deadline_s(self.log_bytes.get(w, 0) if req.resend_to else 0))
                       for w, req in requests.items()}
            for w, f in futures.items():
                try:
                    answers[w] = f.result()
                except grpc.RpcError as exc:
                    failed[w] = WorkerCallFailed.from_rpc_error(w, "Rewire", exc)
        return answers, failed

    def unload(self, worker: str, *, flush_s: float = 0.0) -> bool:
        """Unload the job from ``worker`` (best effort); ``flush_s`` > 0: its pushes on their way arrive first.
        Whether the worker answered that it did."""
        to = self.identity.get(worker)
        if to is None or worker not in self._address:
            return False
        try:
            self._stub(worker).UnloadJob(pb.UnloadJobRequest(to=to, job=self.job, flush_s=flush_s),
                                         timeout=RPC_TIMEOUT_S + flush_s)
        except grpc.RpcError:
            self.log.warning("job.unload_failed", worker=worker)
            return False
        return True

    def warm(self, worker: str, address: str, req: pb.WarmJobRequest,
             done: Callable[[str, pb.WarmJobResponse | None, str], None]) -> None:
        """Ask a spare to warm (or, no slices, to drop) the job's programs without waiting;
        ``done(worker, response or None, error)`` is called when it answers."""
        future = self._stub(worker, address).WarmJob.future(req, timeout=LOAD_TIMEOUT_S)

        def answered(f: Any) -> None:
            exc = f.exception()
            if exc is None:
                done(worker, f.result(), "")
            else:
                done(worker, None, f"{exc.code().name} {exc.details()}" if isinstance(exc, grpc.RpcError) else repr(exc))

        future.add_done_callback(answered)

    def warm_now(self, worker: str, address: str, req: pb.WarmJobRequest, *, timeout_s: float) -> pb.WarmJobResponse:
        """``WarmJob``, waiting for the answer (raises ``grpc.RpcError``)."""
        return self._stub(worker, address).WarmJob(req, timeout=timeout_s)

    def unload_stale(self, worker: str, address: str, to: pb.Identity) -> None:
        """Unload the job from a worker this executor did not load (a lost leader's); best effort."""
        try:
            self._stub(worker, address).UnloadJob(pb.UnloadJobRequest(to=to, job=self.job), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            self.log.warning("job.unload_failed", worker=worker, code=exc.code().name)

    def fetch(self) -> list[pb.StateValue]:
        """Every worker's final states, sorted by name. Raises :class:`WorkerCallFailed` (a lost worker's, first)."""
        states, failed = self.fetch_all()
        if failed:
            raise next(iter(failed.values()))
        return states

    def fetch_all(self) -> tuple[list[pb.StateValue], dict[str, WorkerCallFailed]]:
        """Every worker's final states (sorted by name), fetched from all at once; and the failures by worker.

        A fetch may run as long as its bytes need at the configured bandwidth: it is cut
        (DEADLINE_EXCEEDED) once ``transfer_base_s`` plus the bytes received so far at
        ``transfer_bytes_per_s`` have passed.
        """
        workers = self.workers
        states: list[pb.StateValue] = []
        failed: dict[str, WorkerCallFailed] = {}
        if not workers:
            return states, failed
        with ThreadPoolExecutor(max_workers=len(workers), thread_name_prefix=f"fetch-{self.job}") as pool:
            futures = {w: pool.submit(self._fetch_one, w) for w in workers}
            for w, f in futures.items():
                try:
                    states += f.result()
                except grpc.RpcError as exc:
                    failed[w] = WorkerCallFailed.from_rpc_error(w, "FetchState", exc)
        return sorted(states, key=lambda s: s.state), failed

    def _fetch_one(self, worker: str) -> list[pb.StateValue]:
        """One worker's states; the call is cancelled once it runs past the deadline of the bytes received."""
        call = self._stub(worker).FetchState(pb.FetchStateRequest(to=self.identity[worker], job=self.job))
        start, received = self.clock.monotonic(), [0]
        over = threading.Event()
        done = threading.Event()

        def watch() -> None:
            while not done.wait(min(1.0, self.transfer_base_s / 10)):
                if self.clock.monotonic() - start > self.deadline_s(received[0]):
                    over.set()
                    call.cancel()
                    return

        threading.Thread(target=watch, name=f"fetch-deadline-{worker}", daemon=True).start()
        out: list[pb.StateValue] = []
        try:
            for sv in call:
                received[0] += sum(len(t.data) for t in sv.leaves)
                out.append(sv)
        except grpc.RpcError as exc:
            if over.is_set():
                raise _Deadline(f"FetchState moved {received[0]} bytes in {self.clock.monotonic() - start:.1f} s, past "
                                f"its deadline of {self.deadline_s(received[0]):.1f} s") from exc
            raise
        finally:
            done.set()
        return out

    def close(self) -> None:
        """Unload everywhere, end the streams, close the channels."""
        for w in self.workers:
            self.unload(w)
        with self._lock:
            for s in self._streams:
                s.cancel()
        for ch in self._channels.values():
            ch.close()
