"""Cross-platform export: a CPU-only client lowers a job for the platforms of the pool it goes
to (``jax.export``), records them in the job spec, and the programs run wherever one of them
is the devices' platform; a worker of another platform refuses them at load as the program's
fault (docs/platforms.md). No processes: the workers here are in-process gRPC servers."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import jax
import jax.numpy as jnp
import pytest

from rallypoint.client import Program
from rallypoint.client.compile import compile_program, export_platforms
from rallypoint.client.jobspec import job_spec
from rallypoint.client.program import ProgramError
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.recovery.decide import Verdict
from rallypoint.recovery.load_plan import SlicePlace, load_requests
from rallypoint.workers.programs import PlatformMismatch, load_exported, slice_mesh
from rallypoint.workers.runtime.load import program_fault
from rallypoint.workers.warm import NodeExecutable
from tests.helpers.runtime import Worker, started_workers


def sharded(name: str = "sharded", steps: int = 3) -> Program:
    """One slice of 2 devices: a state sharded over them, a source, and a step that mixes both (a reduction)."""
    prog = Program(name, steps=steps, microbatches=1)
    s = prog.slice("s", devices=2, mesh_axes=("d",))
    w = prog.state("w", slice=s, init=lambda: jnp.arange(8.0, dtype=jnp.float32))
    batch = prog.source("batch", lambda step, mb: jnp.full((8,), step, jnp.float32) * 0.5, slice=s, outputs=("x",),
                        per="step")
    train = prog.node("train", lambda w, x: {"w": w * 0.9 + x + jnp.sum(w) / 8.0, "loss": jnp.mean(w * w)}, slice=s,
                      inputs={"w": w, "x": batch["x"]}, outputs=("w", "loss"), updates={"w": w},
                      shardings={"w": jax.sharding.PartitionSpec("d"), "x": jax.sharding.PartitionSpec("d")})
    prog.metric("loss", train["loss"])
    return prog


def test_a_program_exported_for_cuda_and_cpu_runs_on_cpu_bitwise_as_one_exported_for_cpu() -> None:
    both = compile_program(sharded(), platforms=("cuda", "cpu"))
    assert both.platforms == ("cuda", "cpu")
    assert all(n.platforms == ("cuda", "cpu") for n in both.nodes.values())
    assert all(s.platforms == ("cuda", "cpu") for s in both.states.values())
    spec = job_spec(both)
    assert [list(n.platforms) for n in spec.nodes] == [["cuda", "cpu"]] * len(spec.nodes)
    assert [list(s.platforms) for s in spec.states] == [["cuda", "cpu"]]
    mine = compile_program(sharded())  # this process's platform only: cpu here
    assert mine.platforms == ("cpu",) and job_spec(mine).nodes[0].platforms == ["cpu"]
    assert ReferenceExecutor(both).run().state_digest == ReferenceExecutor(mine).run().state_digest


def test_export_platforms_are_checked_named_as_jax_export_names_them_and_deduplicated() -> None:
    assert export_platforms(["GPU", "cpu", "cuda"]) == ("cuda", "cpu")
    assert export_platforms(None) == (jax.export.default_export_platform(),)
    with pytest.raises(ProgramError, match="cannot export for platform 'metal'"):
        compile_program(sharded(), platforms=("metal",))


def test_a_program_lowered_for_another_platform_is_refused_at_load_as_the_programs_fault() -> None:
    tpu = compile_program(sharded("tpu-only"), platforms=("tpu",))
    mesh = slice_mesh(jax.devices()[:2], (2,), ("d",))
    with pytest.raises(PlatformMismatch, match="exported for tpu, but this worker's devices are cpu") as info:
        load_exported(tpu.states["w"].exported_init, mesh)
    assert program_fault(info.value)  # the job fails; no worker is blamed
    with pytest.raises(PlatformMismatch, match="--platform cpu"):
        NodeExecutable(tpu.nodes["train"].exported, mesh)


@pytest.fixture
def worker() -> Iterator[Worker]:
    with started_workers() as ws:
        yield ws["wA"]


def test_a_worker_asked_to_load_a_tpu_only_job_fails_the_job_not_itself_and_serves_on(worker: Worker) -> None:
    def request(compiled):  # noqa: ANN001, ANN202
        place = {"s": SlicePlace(worker.worker_id, worker.address, worker.incarnation, (0, 1))}
        return load_requests(job_spec(compiled), place, cluster="test", term=1)[worker.worker_id]

    with pytest.raises(grpc.RpcError) as info:
        worker.stub.LoadJob(request(compile_program(sharded("tpu-only"), platforms=("tpu",))), timeout=60)
    f = WorkerCallFailed.from_rpc_error(worker.worker_id, "LoadJob", info.value)
    assert f.verdict is Verdict.PROGRAM and f.program is not None, f
    assert "exported for tpu, but this worker's devices are cpu" in f.details, f.details
    assert worker.service.loaded("tpu-only") is None
    resp = worker.stub.LoadJob(request(compile_program(sharded("both"), platforms=("cuda", "cpu"))), timeout=60)
    assert resp.load_s > 0 and worker.service.loaded("both") is not None


def test_rallypoint_run_exports_for_what_it_is_told_cpu_for_the_embedded_cluster_and_its_own_for_the_reference(
) -> None:
    from rallypoint.client.commands.clusters import export_platforms_for

    assert export_platforms_for("cuda,cpu", reference=False, cluster="c@127.0.0.1:1") == ("cuda", "cpu")
    assert export_platforms_for(None, reference=False, cluster=None) == ("cpu",)
    assert export_platforms_for(None, reference=True, cluster=None) is None
