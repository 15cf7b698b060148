"""The worker's warm cache (workers/warm.py) with real exported programs and real JAX compiles."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
import structlog

from rallypoint.client.compile import CompiledProgram, compile_program
from rallypoint.client.jobspec import job_spec
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.programs import load_exported, slice_mesh
from rallypoint.workers.warm import NodeExecutable, WarmCache, WarmEntry, compile_exported, program_key
from tests.examples import example

LOG = structlog.get_logger("test")


@pytest.fixture(scope="module")
def spec() -> pb.JobSpec:
    compiled: CompiledProgram = compile_program(example("pipeline_mlp").build(steps=2))
    return job_spec(compiled)


def request(spec: pb.JobSpec, slices: dict[str, tuple[int, ...]], job: str = "") -> pb.WarmJobRequest:
    shapes = {s.slice: s for s in spec.slices}
    req = pb.WarmJobRequest(to=pb.Identity(cluster="test", worker_id="w"), job=job or spec.job)
    for name, devices in slices.items():
        req.slices.append(pb.SliceAssignment(slice=name, devices=devices, mesh_shape=shapes[name].mesh_shape,
                                             mesh_axes=shapes[name].mesh_axes))
    req.nodes.extend(n for n in spec.nodes if n.slice in slices)
    return req


def zeros_for(node: pb.NodeProgram) -> list[np.ndarray]:
    exp = jax.export.deserialize(bytearray(node.exported))
    return [np.full(a.shape, 0.5, a.dtype) for a in exp.in_avals]


def test_a_warm_executable_serves_the_first_call_and_matches_a_cold_compile_bitwise(spec: pb.JobSpec) -> None:
    cache = WarmCache(log=LOG)
    req = request(spec, {"stage1": (1,)})
    resp = cache.warm(req, jax.devices())
    nodes = [n for n in spec.nodes if n.slice == "stage1"]
    assert set(resp.compile_s) == {n.name for n in nodes} and not resp.failed and resp.warm_s > 0
    assert cache.jobs() == {spec.job: sorted(n.name for n in nodes)}
    mesh = slice_mesh([jax.devices()[1]], req.slices[0].mesh_shape, req.slices[0].mesh_axes)
    for n in nodes:
        entry = cache.take(program_key(spec.job, n, req.slices[0]))
        assert entry is not None and entry.done.is_set() and entry.compiled is not None
        warm, cold = NodeExecutable(n.exported, mesh, entry), NodeExecutable(n.exported, mesh)
        assert (warm.expected, cold.expected) == ("warm", "cold")
        assert warm.first_report() is None  # nothing to say before the first call
        args = zeros_for(n)
        got, want = warm(*args), cold(*args)
        ref = load_exported(n.exported, mesh)(*args)
        for a, b, c in zip(got, want, ref, strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)) and np.array_equal(np.asarray(a), np.asarray(c))
        assert warm.first_report() == ("warm", 0.0)
        source, compile_s = cold.first_report()  # type: ignore[misc]
        assert source == "compiled" and compile_s > 0
        assert warm.first_report() is None and cold.first_report() is None  # once
    assert len(cache) == 0


def test_other_devices_or_another_program_miss(spec: pb.JobSpec) -> None:
    cache = WarmCache(log=LOG)
    req = request(spec, {"stage1": (1,)})
    cache.warm(req, jax.devices())
    n = next(n for n in spec.nodes if n.slice == "stage1")
    other = pb.SliceAssignment()
    other.CopyFrom(req.slices[0])
    other.devices[:] = [2]
    assert cache.take(program_key(spec.job, n, other)) is None
    changed = pb.NodeProgram()
    changed.CopyFrom(n)
    changed.exported = next(m.exported for m in spec.nodes if m.exported != n.exported)
    assert cache.take(program_key(spec.job, changed, req.slices[0])) is None
    assert cache.take(program_key("another-job", n, req.slices[0])) is None
    assert cache.take(program_key(spec.job, n, req.slices[0])) is not None


def test_a_request_replaces_what_is_held_for_the_job_and_an_empty_one_drops_it(spec: pb.JobSpec) -> None:
    cache = WarmCache(log=LOG)
    cache.warm(request(spec, {"stage1": (1,), "stage2": (2,)}), jax.devices())
    cache.warm(request(spec, {"stage1": (1,)}, job="other"), jax.devices())
    again = cache.warm(request(spec, {"stage2": (2,)}), jax.devices())
    assert not again.compile_s  # stage2 was held already: nothing compiled again
    held = cache.jobs()
    assert {n for n in held[spec.job]} == {n.name for n in spec.nodes if n.slice == "stage2"}
    assert "other" in held
    cache.warm(request(spec, {}), jax.devices())
    assert spec.job not in cache.jobs() and "other" in cache.jobs()
    assert cache.drop_job("other") > 0 and len(cache) == 0


def test_a_load_drops_its_job_and_other_jobs_compiled_for_the_devices_it_took(spec: pb.JobSpec) -> None:
    cache = WarmCache(log=LOG)
    cache.warm(request(spec, {"stage1": (1,), "stage2": (2,)}), jax.devices())
    cache.warm(request(spec, {"stage1": (1,)}, job="on-taken-devices"), jax.devices())
    cache.warm(request(spec, {"stage1": (3,)}, job="elsewhere"), jax.devices())
    cache.loaded(pb.LoadJobRequest(job=spec.job, slices=[pb.SliceAssignment(slice="stage1", devices=[1])]))
    assert set(cache.jobs()) == {"elsewhere"}


def test_the_budget_bounds_what_is_held_and_says_what_was_left_out(spec: pb.JobSpec) -> None:
    cache = WarmCache(max_programs=1, log=LOG)
    resp = cache.warm(request(spec, {"stage1": (1,)}), jax.devices())
    stage1 = [n.name for n in spec.nodes if n.slice == "stage1"]
    assert len(stage1) > 1 and len(resp.compile_s) == 1 and len(cache) == 1
    assert set(resp.failed) == set(stage1) - set(resp.compile_s) and "budget" in next(iter(resp.failed.values()))


def test_devices_that_do_not_fit_the_worker_are_refused(spec: pb.JobSpec) -> None:
    with pytest.raises(ValueError, match="do not fit"):
        WarmCache(log=LOG).warm(request(spec, {"stage1": (99,)}), jax.devices())


def test_a_first_call_waits_for_a_warm_compile_still_running_and_counts_the_wait(spec: pb.JobSpec) -> None:
    n = next(n for n in spec.nodes if n.slice == "stage1")
    sa = request(spec, {"stage1": (1,)}).slices[0]
    mesh = slice_mesh([jax.devices()[1]], sa.mesh_shape, sa.mesh_axes)
    entry = WarmEntry()
    exe = NodeExecutable(n.exported, mesh, entry)

    def finish() -> None:
        entry.compiled = compile_exported(jax.export.deserialize(bytearray(n.exported)), mesh)
        entry.done.set()

    threading.Timer(0.2, finish).start()
    exe(*zeros_for(n))
    source, compile_s = exe.first_report()  # type: ignore[misc]
    assert source == "warm" and compile_s >= 0.15


def test_a_failed_warm_compile_falls_back_to_compiling_at_the_first_call(spec: pb.JobSpec) -> None:
    n = next(n for n in spec.nodes if n.slice == "stage1")
    sa = request(spec, {"stage1": (1,)}).slices[0]
    mesh = slice_mesh([jax.devices()[1]], sa.mesh_shape, sa.mesh_axes)
    entry = WarmEntry(error="boom")
    entry.done.set()
    exe = NodeExecutable(n.exported, mesh, entry)
    exe(*zeros_for(n))
    assert exe.first_report()[0] == "compiled"  # type: ignore[index]
