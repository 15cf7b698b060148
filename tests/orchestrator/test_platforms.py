"""The submit-time platform check (pure, over a job spec and the workers' records) and how
`rallypoint workers` shows each worker's platform, device kind and memory."""

from __future__ import annotations

import json

from rallypoint.client.commands.main import device_cell, worker_rows
from rallypoint.etcd.cluster_records import ClusterSnapshot, WorkerInfo, WorkerSnapshot
from rallypoint.etcd.store import KeyValue
from rallypoint.recovery.platforms import platform_refusal, pool_platforms, slice_platforms
from rallypoint.proto import rallypoint_pb2 as pb

GIB = 2**30


def spec(**slices: tuple[list[str], list[str]]) -> pb.JobSpec:
    """A job with, per slice, a node lowered for the first list and a state init for the second."""
    s = pb.JobSpec(job="j")
    for name, (node_platforms, state_platforms) in slices.items():
        s.slices.append(pb.SliceAssignment(slice=name))
        s.nodes.append(pb.NodeProgram(name=f"{name}-step", slice=name, platforms=node_platforms))
        s.states.append(pb.StateProgram(name=f"{name}-w", slice=name, platforms=state_platforms))
    return s


def worker(name: str, record: dict, state: str = "serving", devices: int = 2) -> WorkerSnapshot:
    value = json.dumps({"address": "a", "pid": 9, "devices": devices, "state": state, **record})
    info = WorkerInfo.from_kv(name, KeyValue(f"workers/{name}", value.encode(), 5, 5, 1, 1))
    return WorkerSnapshot(info=info, devices=tuple(range(devices)), holders={}, cordoned=False)


def pool(**workers: WorkerSnapshot) -> ClusterSnapshot:
    return ClusterSnapshot(revision=1, workers=dict(workers), cordoned=frozenset())


CPU = {"platform": "cpu", "device_kind": "cpu", "device_memory_bytes": 0, "deterministic": True}
H100 = {"platform": "cuda", "device_kind": "NVIDIA H100 80GB HBM3", "device_memory_bytes": 80 * GIB,
        "deterministic": True}


def test_a_slice_runs_where_every_one_of_its_programs_was_lowered_for() -> None:
    got = slice_platforms(spec(a=(["cuda", "cpu"], ["cpu", "cuda"]), b=(["cuda", "tpu"], ["tpu"]), c=([], [])))
    assert got == {"a": ("cuda", "cpu"), "b": ("tpu",), "c": None}  # c: a spec from before platforms were recorded


def test_a_pool_of_one_platform_refuses_a_job_exported_for_another_naming_the_slice_and_what_is_on_offer() -> None:
    offered = pool_platforms(pool(w0=worker("w0", CPU), w1=worker("w1", CPU), w2=worker("w2", CPU, state="leaving")))
    assert offered == {"cpu": ["w0", "w1"]}
    why = platform_refusal(spec(ok=(["cuda", "cpu"], ["cuda", "cpu"]), stage1=(["tpu"], ["tpu"])), offered)
    assert why is not None
    assert "slice 'stage1' has programs lowered for tpu" in why and "the pool offers cpu (w0, w1)" in why, why
    assert "'ok'" not in why and "--platform cpu" in why
    assert platform_refusal(spec(ok=(["cuda", "cpu"], ["cuda", "cpu"])), offered) is None


def test_mixed_pools_empty_pools_and_unrecorded_platforms_refuse_nothing_they_need_not() -> None:
    mixed = pool_platforms(pool(w0=worker("w0", CPU), g0=worker("g0", H100), old=worker("old", {})))
    assert mixed == {"cpu": ["old", "w0"], "cuda": ["g0"]}  # a worker that names no platform ran on CPU
    assert platform_refusal(spec(a=(["cuda"], ["cuda"]), b=(["cpu"], ["cpu"])), mixed) is None
    assert platform_refusal(spec(a=(["tpu"], ["tpu"])), {}) is None  # no workers yet: placement waits, as before
    assert platform_refusal(spec(a=([], [])), {"cpu": ["w0"]}) is None


def test_rallypoint_workers_shows_platform_kind_memory_and_nondeterministic_kernels() -> None:
    snap = pool(w0=worker("w0", CPU), g0=worker("g0", H100 | {"deterministic": False}, devices=8))
    rows = {r["worker"]: r for r in worker_rows(snap)}
    assert rows["g0"]["platform"] == "cuda" and rows["g0"]["device_memory_bytes"] == 80 * GIB
    assert device_cell(rows["w0"]) == "cpu x2 (host memory)"
    assert device_cell(rows["g0"]) == "cuda x8 NVIDIA H100 80GB HBM3, 80.0 GiB each, nondeterministic"
