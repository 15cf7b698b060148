"""Jobs on a real local cluster (tests/integration/): the 4-stage pipeline and its reference digest, a
one-slice counter job, a run that injects faults, what etcd says of the cluster after, a leader
run in the test's own process (for hooks a command line cannot carry), and a small cluster a test
module shares (one worker of one device, one coordinator)."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from rallypoint.client import Program
from rallypoint.client.commands.faults import Fault, FaultInjector
from rallypoint.client.compile import CompiledProgram, compile_program
from rallypoint.client.reference import ReferenceExecutor, RunResult
from rallypoint.client.submission import submit
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig, is_running
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from rallypoint.proto import rallypoint_pb2 as pb
from tests.conftest import wait_until
from tests.examples import example


STEPS = 24
EVERY = 5
SLICES = ("stage0", "stage1", "stage2", "stage3")
EACH_KIND_OF_SLICE = ("stage0", "stage1", "stage3")
"""A slice of each kind the pipeline has: the first (the source's), a middle one, the last (the loss's). stage2
takes stage1's paths (a producer upstream, a consumer downstream); a test run per slice skips it."""


@contextlib.contextmanager
def small_cluster(state_dir: Path, compile_cache: Path, *, spares: int = 0) -> Iterator[LocalCluster]:
    """One worker of one device, ``spares`` more, one coordinator: stopped at the end, every process checked gone."""
    lc = LocalCluster.start(LocalClusterConfig(state_dir=state_dir, workers=1, spares=spares, devices_per_worker=1,
                                               coordinators=1, lease_ttl_s=2, compile_cache_dir=compile_cache))
    try:
        yield lc
    finally:
        lc.stop()
        assert not [p for p in lc.processes if is_running(p)], "processes left running"


def run_dir_of(lc: LocalCluster, job: str) -> Path:
    """The directory of the job's newest run (its LATEST) under the cluster's checkpoint root."""
    return lc.checkpoint_dir / job / (lc.checkpoint_dir / job / "LATEST").read_text().strip()


def nodes_of(compiled: CompiledProgram, slice_name: str) -> set[str]:
    return {n for n, spec in compiled.program.nodes.items() if spec.slice == slice_name}


@functools.cache
def pipeline_and_digest(steps: int = STEPS) -> tuple[CompiledProgram, str]:
    """The 4-stage pipeline of ``steps`` steps compiled, and the digest of its in-process reference run: made once
    per session (tests/integration/conftest.py's ``pipeline`` fixture, and test_adoption.py's, share it)."""
    compiled = compile_program(example("pipeline_mlp").build(steps=steps))
    return compiled, ReferenceExecutor(compiled).run().state_digest


def run(lc: LocalCluster, compiled: CompiledProgram, faults: list[Fault], *,
        on_event: Callable[[pb.JobEvent], None] | None = None, corrupt_flag: str = "",
        **recovery: Any) -> tuple[RunResult, FaultInjector]:
    """``corrupt_flag``: the workers' --fault-corrupt-flag, where ``faults`` corrupt (workers/corruption.py)."""
    injector = FaultInjector(faults, lc.endpoints, lc.keys.cluster, corrupt_flag=corrupt_flag)

    def both(ev: pb.JobEvent) -> None:
        injector.on_event(ev)
        if on_event is not None:
            on_event(ev)

    recovery.setdefault("checkpoint_every", EVERY)
    result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, on_event=both, **recovery)
    assert all("error" not in f for f in injector.fired), injector.fired
    return result, injector


def assert_settled(lc: LocalCluster) -> None:
    store = lc.store()
    try:
        assert all(not s.holders for s in read_cluster(store, lc.keys).workers.values()), "device leases outlived the job"
    finally:
        store.close()


def cluster_args(lc: LocalCluster) -> list[str]:
    """``--cluster NAME@ENDPOINT`` with the cluster's certificates (``--tls-dir``)."""
    return ["--cluster", f"{lc.keys.cluster}@{lc.endpoints[0]}", "--tls-dir", str(lc.tls_dir)]


def snapshot(lc: LocalCluster) -> Any:
    store = lc.store()
    try:
        return read_cluster(store, lc.keys)
    finally:
        store.close()


def counter_job(steps: int, name: str = "urgent", checkpoint_every: int = 100) -> Program:
    # Few checkpoints: each commit waits the cluster's commit_delay_s (1 s) below, one after another, and the job
    # ends once the last one is in: with one every 10 steps the urgent job would hold the slice ~10 s for nothing.
    prog = Program(name, steps=steps, checkpoint_every=checkpoint_every)
    s = prog.slice("only", devices=1)
    total = prog.state("total", slice=s, init=lambda: jnp.zeros((4,)))
    src = prog.source("x", lambda step, mb: {"x": jnp.full((4,), step, jnp.float32)}, slice=s, per="step",
                      outputs=("x",))
    prog.node("add", lambda total, x: {"total": total + x}, slice=s, inputs={"total": total, "x": src["x"]},
                     outputs=("total",), updates={"total": total})
    return prog


def leader(lc: LocalCluster) -> tuple[str, int] | None:
    store = lc.store()
    try:
        kv = store.get(lc.keys.leader)
    finally:
        store.close()
    return (kv.json()["coordinator"], kv.create_revision) if kv else None


def job_record(lc: LocalCluster, job: str) -> dict[str, Any]:
    store = lc.store()
    try:
        kv = store.get(lc.keys.job(job))
        assert kv is not None
        return kv.json()
    finally:
        store.close()


@contextlib.contextmanager
def leader_in_process(lc: LocalCluster, hooks: ExecutorHooks) -> Iterator[Any]:
    """A real coordinator of this process leads ``lc``, its executors built with ``hooks`` (``ExecutorHooks.leased``
    is a callable: no command line carries it); the cluster's own coordinators are stopped first (SIGTERM: they
    step down). Stopped on the way out."""
    from rallypoint.basics.tls import TlsConfig
    from rallypoint.cluster import local_security
    from rallypoint.orchestrator.service.coordinator import Coordinator, CoordinatorConfig
    from rallypoint.orchestrator.service.jobs import serve_jobs

    cfg, name = lc.config, "c-test"
    for p in lc.processes:
        if p.role == "coordinator":
            lc.signal(p.name, signal.SIGTERM)
            lc.reap(p.name, timeout_s=30)
    own = local_security.issue_process(lc.tls_dir, name, role="coordinator", host=cfg.host, cluster=cfg.cluster,
                                       net=None)  # a folder of its own: ca.crt and its pair
    c = Coordinator(CoordinatorConfig(
        tls=TlsConfig.from_dir(own, name).check_role("coordinator"), cluster=cfg.cluster, coordinator_id=name,
        endpoints=tuple(lc.endpoints), lease_ttl_s=cfg.lease_ttl_s, checkpoint_dir=str(lc.checkpoint_dir),
        suspect_after_s=cfg.suspect_after_s, host=cfg.host, hooks=hooks))
    serve_jobs(c)
    thread = threading.Thread(target=c.run, name=f"coordinator-{name}", daemon=True)
    thread.start()
    try:
        wait_until(lambda: c.election.is_leader, 20, "the in-process coordinator to lead")
        yield c
    finally:
        c.stop()
        thread.join(30)
