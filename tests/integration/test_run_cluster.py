"""Programs on a real local cluster: workers run the exported nodes, tensors move worker to
worker, and every run ends in bitwise the state of the in-process reference. (`rallypoint run`
on its embedded cluster: tests/integration/test_recovery.py, with a fault injected.)"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rallypoint.client.compile import compile_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.submission import JobError, submit
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig, is_running
from tests.conftest import stop_cluster
from tests.examples import example
from tests.helpers.cli import ROOT, rp
from tests.helpers.runtime import TIB, tiny


@pytest.mark.parametrize("name,steps", [("pipeline_mlp", 6), ("rl_loop", 7), ("data_parallel", 5)])
def test_examples_on_the_cluster_end_bitwise_equal_to_the_reference(
    local_cluster: Callable[..., LocalCluster], name: str, steps: int
) -> None:
    program = example(name).build(steps=steps)
    workers = len(program.slices)
    devices = max(s.devices for s in program.slices.values())
    lc = local_cluster(workers=workers, spares=1, devices_per_worker=devices, coordinators=1)
    compiled = compile_program(program)
    seen: list[int] = []
    events: list[str] = []
    result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, window=2,
                    on_step=lambda s, m: seen.append(s), on_event=lambda ev: events.append(ev.event))
    reference = ReferenceExecutor(compiled).run()
    assert result.state_digest == reference.state_digest
    assert seen == list(range(steps))
    assert events[0] == "job.placed" and events[-1] == "job.finished"
    for mine, theirs in zip(result.metrics, reference.metrics, strict=True):
        assert mine.keys() == theirs.keys()
        for k in mine:
            assert mine[k] == pytest.approx(theirs[k], rel=1e-6, abs=1e-9)
    store = lc.store()
    try:
        record = store.get(lc.keys.job(program.name)).json()
        assert record["state"] == "succeeded" and record["step_done"] == steps
        assert set(record["placement"]) == set(program.slices)
        # Slices went to distinct workers (one per worker here), and the spare stayed free.
        assert len({p["worker"] for p in record["placement"].values()}) == workers
        snap = read_cluster(store, lc.keys)
        assert all(not s.holders for s in snap.workers.values()), "device leases outlived the job"
    finally:
        store.close()


def test_a_slice_larger_than_any_worker_is_refused_before_anything_starts() -> None:
    r = rp("run", "--devices-per-worker", "2", str(ROOT / "examples" / "data_parallel.py"), check=False)
    assert r.returncode == 1
    assert "slice 'dp' needs 4 devices but a worker has 2" in r.stderr


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory, compile_cache: Path) -> Iterator[LocalCluster]:
    """A cluster of one worker of one device, no spare, one coordinator: for jobs that must fail, leaving it as it was."""
    lc = LocalCluster.start(LocalClusterConfig(state_dir=tmp_path_factory.mktemp("one-worker"), workers=1, spares=0,
                                               devices_per_worker=1, coordinators=1, lease_ttl_s=2,
                                               compile_cache_dir=compile_cache))
    try:
        yield lc
    finally:
        stop_cluster(lc)
        assert not [p for p in lc.processes if is_running(p)], "processes left running"


def test_a_job_the_cluster_cannot_place_fails_with_the_reason_and_holds_no_devices(one_worker: LocalCluster) -> None:
    lc = one_worker
    compiled = compile_program(example("pipeline_mlp").build(steps=2))  # 4 slices, 1 worker
    with pytest.raises(JobError, match="no spare worker has 1 free devices"):
        submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster)
    store = lc.store()
    try:
        assert store.get(lc.keys.job("pipeline-mlp")).json()["state"] == "failed"
        assert all(not s.holders for s in read_cluster(store, lc.keys).workers.values())
    finally:
        store.close()


def test_a_job_whose_init_asks_for_a_tebibyte_fails_at_once_naming_it_and_the_worker_stays_live_unfenced(
    one_worker: LocalCluster,
) -> None:
    lc = one_worker
    store = lc.store()
    try:
        before = {w: s.info.incarnation for w, s in read_cluster(store, lc.keys).workers.items()}
        events: list[str] = []
        t0 = time.monotonic()
        with pytest.raises(JobError) as info:
            submit(compile_program(tiny("huge-init", TIB)), endpoints=lc.endpoints, cluster=lc.keys.cluster,
                   on_event=lambda ev: events.append(ev.event))
        took = time.monotonic() - t0
        message = str(info.value)
        # The node (the state's init), the worker and the error, at once: no recovery, no spare waited for
        # (blaming the worker would fence it and then wait wait_timeout_s, 60 s, for a spare that never comes).
        assert "state 'w' init failed on worker" in message and "RESOURCE_EXHAUSTED" in message, message
        assert "1099511627776" in message and took < 30, (took, message)
        assert "job.recovering" not in events, events
        record = store.get(lc.keys.job("huge-init")).json()
        assert record["state"] == "failed" and record["failures"] == [] and record["recoveries"] == []
        loaded_on = [w for w in before if f"on worker {w}:" in message]
        assert len(loaded_on) == 1, message
        snap = read_cluster(store, lc.keys)
        # Every worker, the one that loaded it too, is still registered as the same incarnation, uncordoned, unfenced.
        assert {w: s.info.incarnation for w, s in snap.workers.items()} == before
        assert not snap.cordoned and not snap.lost and all(not s.holders for s in snap.workers.values())
    finally:
        store.close()


def test_a_pool_of_cpu_workers_refuses_a_job_exported_for_tpu_and_runs_one_exported_for_cuda_and_cpu(
    one_worker: LocalCluster,
) -> None:
    lc = one_worker
    store = lc.store()
    try:
        record = store.get(lc.keys.worker("w0")).json()  # what `rallypoint workers` shows
        assert (record["platform"], record["device_kind"], record["deterministic"]) == ("cpu", "cpu", True)
        with pytest.raises(JobError) as info:
            submit(compile_program(tiny("tpu-only", 4), platforms=("tpu",)), endpoints=lc.endpoints,
                   cluster=lc.keys.cluster)
        message = str(info.value)
        assert "FAILED_PRECONDITION" in message and "slice 's' has programs lowered for tpu" in message, message
        assert "the pool offers cpu (w0)" in message, message
        assert store.get(lc.keys.job("tpu-only")) is None  # refused before anything was written
        compiled = compile_program(tiny("cuda-and-cpu", 4), platforms=("cuda", "cpu"))
        result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster)
        assert result.state_digest == ReferenceExecutor(compiled).run().state_digest
        assert all(not s.holders for s in read_cluster(store, lc.keys).workers.values())
    finally:
        store.close()
