"""Programs on a real local cluster: workers run the exported nodes, tensors move worker to
worker, and every run ends in bitwise the state of the in-process reference. (`rallypoint run`
on its embedded cluster: tests/integration/test_recovery.py, with a fault injected.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rallypoint.client.compile import compile_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.submit import JobError, submit
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.cluster.local import LocalCluster
from tests.client.test_cli import ROOT, rp
from tests.examples import example


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


def test_a_job_the_cluster_cannot_place_fails_with_the_reason_and_holds_no_devices(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    lc = local_cluster(workers=1, spares=0, devices_per_worker=1, coordinators=1)
    compiled = compile_program(example("pipeline_mlp").build(steps=2))  # 4 slices, 1 worker
    with pytest.raises(JobError, match="no spare worker has 1 free devices"):
        submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster)
    store = lc.store()
    try:
        assert store.get(lc.keys.job("pipeline-mlp")).json()["state"] == "failed"
        assert all(not s.holders for s in read_cluster(store, lc.keys).workers.values())
    finally:
        store.close()
