"""The job executor one step at a time over the fakes, and JobProgress alone: a two-stage job spec and
the harnesses that drive them (tests/orchestrator/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rallypoint.basics.clock import FakeClock
from rallypoint.etcd.commits import CheckpointCommit, commit_record_path
from rallypoint.etcd.keys import Keys
from rallypoint.orchestrator.job.executor import JobExecutor
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from rallypoint.orchestrator.job.progress import JobProgress
from rallypoint.orchestrator.job.state import JobState
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.replay import Graph
from tests.fakes import FakeElection, FakeWorkers, MemoryStore, register_worker


B = pb.InputBinding


def pipeline_spec(steps: int = 20, checkpoint_every: int = 5, **kw: Any) -> pb.JobSpec:
    """Two stages: fwd0 on s0 (state p0) feeds fwd1 on s1 (state p1)."""
    return pb.JobSpec(
        job="pipe", steps=steps, microbatches=1, window=2, checkpoint_every=checkpoint_every,
        slices=[pb.SliceAssignment(slice="s0", mesh_shape=[1]), pb.SliceAssignment(slice="s1", mesh_shape=[1])],
        nodes=[pb.NodeProgram(name="fwd0", slice="s0", every=1,
                              inputs=[pb.InputBinding(arg="p", kind=B.STATE, state="p0")]),
               pb.NodeProgram(name="fwd1", slice="s1", every=1,
                              inputs=[pb.InputBinding(arg="x", kind=B.REF, node="fwd0", output="y"),
                                      pb.InputBinding(arg="p", kind=B.STATE, state="p1")])],
        states=[pb.StateProgram(name="p0", slice="s0", producer_node="fwd0", producer_every=1),
                pb.StateProgram(name="p1", slice="s1", producer_node="fwd1", producer_every=1)],
        **kw)


def eval_spec(steps: int = 20, checkpoint_every: int = 5) -> pb.JobSpec:
    """:func:`pipeline_spec` with a slice ``ev`` that holds no state: a source ``held`` every step, and ``evaluate``
    every 3 steps reading it and s1's state p1."""
    spec = pipeline_spec(steps=steps, checkpoint_every=checkpoint_every)
    spec.slices.append(pb.SliceAssignment(slice="ev", mesh_shape=[1]))
    spec.nodes.extend([pb.NodeProgram(name="held", slice="ev", every=1),
                       pb.NodeProgram(name="evaluate", slice="ev", every=3,
                                      inputs=[pb.InputBinding(arg="x", kind=B.REF, node="held", output="x"),
                                              pb.InputBinding(arg="p", kind=B.STATE, state="p1")])])
    return spec


class Harness:
    def __init__(self, tmp_path: Path, *, workers: int = 3, spec: pb.JobSpec | None = None, adopted: bool = False,
                 store: MemoryStore | None = None, events: list[pb.JobEvent] | None = None, resume: bool = False,
                 hooks: ExecutorHooks = ExecutorHooks()) -> None:
        self.keys = Keys("t")
        self.store = store or MemoryStore()
        self.clock = FakeClock()
        self.incarnations = {f"w{i}": register_worker(self.store, self.keys, f"w{i}", 1) for i in range(workers)} \
            if store is None else {}
        self.election = FakeElection(self.store, self.keys, self.clock)
        self.events: list[pb.JobEvent] = [] if events is None else events  # what the executor emits
        self.spec = spec or pipeline_spec()
        self.workers = FakeWorkers(self.spec.job, self.spec, self.store, self.keys)
        self.x = JobExecutor(self.spec, store=self.store, keys=self.keys, election=self.election,
                             emit=self.events.append, clock=self.clock, checkpoint_root=str(tmp_path),
                             adopted=adopted, resume=resume, hooks=hooks, loss_grace_s=0.0, workers=self.workers)

    def names(self) -> list[str]:
        return [e.event for e in self.events if e.event != "step.done"]

    def record(self) -> dict[str, Any]:
        kv = self.store.get(self.keys.job(self.spec.job))
        assert kv is not None
        return kv.json()

    def leases(self) -> list[str]:
        return [kv.key for kv in self.store.get_prefix(self.keys.leases)[0]]

    def steps_until(self, done: int, limit: int = 500) -> None:
        for _ in range(limit):
            if self.x.progress.completed >= done:
                return
            self.x.step(timeout_s=0.0)
        raise AssertionError(f"stuck at step {self.x.progress.completed} (wanted {done})")

    def worker_of(self, slice_name: str) -> str:
        return self.x.places.slices[slice_name].worker


def join_while_waiting(h: Harness, worker: str = "w9", after_s: float = 5.0) -> list[Any]:
    """Register ``worker`` (1 device) once the executor has slept ``after_s`` of its fake clock from now (a worker
    joins while the job waits for room); the list holds its registration once it joined."""
    sleep, joined, start = h.clock.sleep, [], h.clock.monotonic()

    def sleep_then_join(seconds: float) -> None:
        sleep(seconds)
        if not joined and h.clock.monotonic() - start >= after_s:
            joined.append(register_worker(h.store, h.keys, worker, 1))

    h.clock.sleep = sleep_then_join  # type: ignore[method-assign]
    return joined


def recovered(h: Harness, count: int) -> None:
    for _ in range(100):
        if len(h.x.recovery.records) >= count and h.x.state is JobState.RUNNING:
            return
        h.x.step(timeout_s=0.0)
    raise AssertionError(f"no recovery {count}")


def progress(steps: int = 20) -> JobProgress:
    spec = pipeline_spec(steps=steps)
    return JobProgress(spec, Graph.from_spec(spec))


def run(p: JobProgress, step: int, *, loss: float | None = None) -> list[int]:
    """Both nodes' instances of ``step`` heard; the steps that completed."""
    for node in ("fwd0", "fwd1"):
        p.instance(pb.InstanceDone(node=node, step=step, compute_s=0.5,
                                   metrics={"loss": loss} if loss is not None and node == "fwd1" else {}))
    return [d.step for d in p.complete()]


def a_run(tmp_path: Path, store: MemoryStore | None = None, *, commits: tuple[int, ...] = (7,),
          keep_runs: int = 0) -> Harness:
    """A finished run of job "pipe": the fake workers commit steps 5, 10 and 15 of both slices in etcd;
    this adds ``commits`` of both slices inside its run directory, in etcd and beside the checkpoints."""
    h = Harness(tmp_path, store=store)
    h.x.keep_runs = keep_runs
    assert h.x.run() is JobState.SUCCEEDED
    assert h.x.run_dir is not None
    for s in ("s0", "s1"):
        for step in commits:
            c = CheckpointCommit("pipe", s, step, str(h.x.run_dir / s / str(step)), "x")
            h.store.put(h.keys.checkpoint("pipe", s, step), json.dumps(c.to_json()))
            commit_record_path(h.x.run_dir, s, step).parent.mkdir(parents=True, exist_ok=True)
            commit_record_path(h.x.run_dir, s, step).write_text(json.dumps(c.to_json()))
    return h
