"""Two worker runtimes (wA, wB, 4 devices each) served over gRPC in this process, and the examples loaded
on them as the leader would place them (tests/workers/, tests/client/); the small jobs whose program
fails on a worker."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import jax
import jax.numpy as jnp

from rallypoint.basics.errors import Fenced
from rallypoint.client import Program
from rallypoint.client.compile import CompiledProgram, compile_program
from rallypoint.client.jobspec import job_spec
from rallypoint.client.reference import ReferenceExecutor, RunResult
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.proto import codec
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc
from rallypoint.recovery.load_plan import SlicePlace, instances_per_step, load_requests
from rallypoint.workers.daemon import StaleIncarnation
from rallypoint.workers.faults import NO_FAULTS, WorkerFaults
from rallypoint.workers.runtime.service import WorkerRuntimeService
from tests.conftest import wait_until
from tests.examples import example


STEPS = {"pipeline_mlp": 4, "rl_loop": 7, "data_parallel": 4}
# slice -> (worker, local device indices); workers wA and wB hold 4 devices each
PLACEMENTS: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {
    # stages alternate between the workers: every stage-to-stage edge crosses them,
    # the source feeds fwd0 on its own slice (local delivery)
    "pipeline_mlp": {"stage0": ("wA", (0,)), "stage1": ("wB", (0,)), "stage2": ("wA", (1,)), "stage3": ("wB", (1,))},
    # sampler -> reward on one worker (another slice, delivered locally); the trainer's
    # policy reaches `sync` on the sampler by a state push across workers
    "rl_loop": {"sampler": ("wA", (0,)), "reward": ("wA", (1,)), "trainer": ("wB", (2,))},
    "data_parallel": {"dp": ("wB", (0, 1, 2, 3))},
}


_compiled: dict[str, tuple[CompiledProgram, RunResult]] = {}


def compiled_and_reference(name: str) -> tuple[CompiledProgram, RunResult]:
    if name not in _compiled:
        compiled = compile_program(example(name).build(steps=STEPS[name]))
        _compiled[name] = (compiled, ReferenceExecutor(compiled).run())
    return _compiled[name]


@dataclass
class Worker:
    worker_id: str
    address: str
    incarnation: int
    server: grpc.Server
    service: WorkerRuntimeService
    channel: grpc.Channel
    stub: pb_grpc.WorkerRuntimeStub
    fence: threading.Event

    def to(self, incarnation: int | None = None) -> pb.Identity:
        inc = self.incarnation if incarnation is None else incarnation
        return pb.Identity(cluster="test", worker_id=self.worker_id, incarnation=inc, term=1)


def make_admit(worker_id: str, incarnation: int, fence: threading.Event) -> Callable[[pb.Identity], None]:
    def admit(to: pb.Identity) -> None:
        if fence.is_set():
            raise Fenced(f"worker {worker_id}", "test fence")
        if to.incarnation and to.incarnation != incarnation:
            raise StaleIncarnation(worker_id, to.incarnation, incarnation)
    return admit


@contextmanager
def started_workers(commit_factory: Callable[[], Callable[[CheckpointCommit], None]] | None = None,
                    faults: dict[str, WorkerFaults] | None = None) -> Iterator[dict[str, Worker]]:
    """``faults``: the fault hooks of a worker, by its id (none for the others)."""
    started: list[Worker] = []
    devs = jax.devices()
    for i, wid in enumerate(("wA", "wB")):
        incarnation, fence = 100 + i, threading.Event()
        service = WorkerRuntimeService(wid, admit=make_admit(wid, incarnation, fence), devices=devs[4 * i : 4 * i + 4],
                                       incarnation=lambda inc=incarnation: inc, commit_factory=commit_factory,
                                       faults=(faults or {}).get(wid, NO_FAULTS))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        pb_grpc.add_WorkerRuntimeServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        started.append(Worker(wid, f"127.0.0.1:{port}", incarnation, server, service, channel,
                              pb_grpc.WorkerRuntimeStub(channel), fence))
    try:
        yield {w.worker_id: w for w in started}
    finally:
        for w in started:
            w.channel.close()
            w.service.close()
            w.server.stop(grace=None)


@dataclass
class Events:
    """One worker's JobEvents stream, read on a thread: its batches' events, in order."""

    call: Any
    items: list[pb.InstanceDone] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.call.initial_metadata()  # the worker has subscribed: a fence set after this loses no event
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.items.extend(batch.done)
        except grpc.RpcError:
            pass
        finally:
            self.ended.set()


@dataclass
class Job:
    compiled: CompiledProgram
    spec: pb.JobSpec
    requests: dict[str, pb.LoadJobRequest]
    workers: dict[str, Worker]
    events: dict[str, Events]

    def grant(self, until: int) -> None:
        for wid in self.requests:
            self.workers[wid].stub.RunSteps(pb.RunStepsRequest(to=self.workers[wid].to(), job=self.spec.job,
                                                               until_step=until), timeout=10)

    def done(self) -> list[pb.InstanceDone]:
        return [ev for e in self.events.values() for ev in list(e.items)]

    def wait_instances(self, until: int, timeout_s: float = 60) -> None:
        want = sum(instances_per_step(self.spec, s) for s in range(until))
        wait_until(lambda: len(self.done()) >= want, timeout_s, f"{want} instances of {self.spec.job}")
        errors = [ev.error for ev in self.done() if ev.error]
        assert errors == []
        assert len(self.done()) == want

    def wait_idle(self, timeout_s: float = 30) -> None:
        """Wait until every device thread of the job, on every worker, has looked for an instance to run after
        this call and found none it may run: with no grant or value still on its way, nothing runs after it. (A
        proof of "nothing ran" without a sleep of a guessed length.)"""
        schedulers = [self.workers[wid].service.loaded(self.spec.job).scheduler for wid in self.requests]
        before = [dict(s.idle_looks) for s in schedulers]
        for wid in self.requests:  # wake every waiting thread, so each looks once more now
            control = self.workers[wid].service.loaded(self.spec.job).control
            with control.cv:
                control.cv.notify_all()
        wait_until(lambda: all(s.idle_looks[k] > b[k] for s, b in zip(schedulers, before, strict=True) for k in b),
                   timeout_s, f"every device thread of {self.spec.job} idle")

    def fetch_states(self) -> dict[str, Any]:
        states: dict[str, Any] = {}
        for wid in self.requests:
            w = self.workers[wid]
            for sv in w.stub.FetchState(pb.FetchStateRequest(to=w.to(), job=self.spec.job), timeout=60):
                leaves = [codec.from_tensor(t) for t in sv.leaves]
                states[sv.state] = self.compiled.states[sv.state].tree.unflatten(leaves)
        return states

    def unload(self) -> None:
        for wid in self.requests:
            w = self.workers[wid]
            w.stub.UnloadJob(pb.UnloadJobRequest(to=w.to(), job=self.spec.job), timeout=10)


def load(name: str, workers: dict[str, Worker], **request: Any) -> Job:
    """Load an example on the workers; ``request`` sets fields of every LoadJobRequest (checkpoints, say)."""
    compiled, _ = compiled_and_reference(name)
    spec = job_spec(compiled)
    placement = {s: SlicePlace(wid, workers[wid].address, workers[wid].incarnation, devs)
                 for s, (wid, devs) in PLACEMENTS[name].items()}
    requests = load_requests(spec, placement, cluster="test", term=1)
    for wid, req in requests.items():
        for field_name, value in request.items():
            setattr(req, field_name, value)
        resp = workers[wid].stub.LoadJob(req, timeout=120)
        assert resp.load_s > 0
    events = {wid: Events(workers[wid].stub.JobEvents(pb.JobEventsRequest(to=workers[wid].to(), job=spec.job)))
              for wid in requests}
    return Job(compiled, spec, requests, workers, events)


TIB = 2**38  # float32s: 1 TiB


def tiny(name: str, elements: int) -> Program:
    """One slice of one device: a state of ``elements`` float32s, a node that adds one to it each step."""
    prog = Program(name, steps=2)
    s = prog.slice("s", devices=1, mesh_axes=("d",))
    w = prog.state("w", slice=s, init=lambda: jnp.ones((elements,), jnp.float32))
    step = prog.node("add", lambda w: {"w": w + 1.0}, slice=s, inputs={"w": w}, outputs=("w",), updates={"w": w})
    del step
    return prog
