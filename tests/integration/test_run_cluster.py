"""Programs on a real local cluster: workers run the exported nodes, tensors move worker to
worker, and every run ends in bitwise the state of the in-process reference."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from client.compile import compile_program
from client.reference import ReferenceExecutor
from client.submit import JobError, submit
from orchestrator.devices import read_cluster
from orchestrator.local_cluster import LocalCluster
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


def test_rallypoint_run_on_the_embedded_cluster_prints_the_reference_digest() -> None:
    job = str(ROOT / "examples" / "rl_loop.py")
    cluster = [json.loads(x) for x in rp("run", "--json", "--steps", "4", job, timeout=300).stdout.splitlines()]
    reference = [json.loads(x) for x in rp("run", "--reference", "--json", "--steps", "4", job).stdout.splitlines()]
    assert cluster[-1]["event"] == "job.finished"
    assert cluster[-1]["state_digest"] == reference[-1]["state_digest"]
    assert [e["step"] for e in cluster[:-1]] == [0, 1, 2, 3]


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


def test_a_worker_killed_mid_job_fails_the_job_with_the_reason_instead_of_hanging(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    import signal
    import threading

    lc = local_cluster(workers=4, spares=0, devices_per_worker=1, coordinators=1)
    compiled = compile_program(example("pipeline_mlp").build(steps=400))
    placed: dict[str, str] = {}
    started = threading.Event()

    def on_event(ev) -> None:  # type: ignore[no-untyped-def]
        if ev.event == "job.placed":
            placed.update({s: p["worker"] for s, p in json.loads(ev.detail).items()})
        if ev.event == "step.done" and ev.step == 2:
            started.set()

    def kill_when_running() -> None:
        if started.wait(120):
            lc.signal(placed["stage2"], signal.SIGKILL)

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    try:
        with pytest.raises(JobError, match=f"worker {placed.get('stage2', 'w')}|lost|stopped reporting"):
            submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, on_event=on_event)
    finally:
        started.set()
        killer.join()
    store = lc.store()
    try:
        record = store.get(lc.keys.job("pipeline-mlp")).json()
        assert record["state"] == "failed" and placed["stage2"] in record["reason"]
        assert 2 < record["step_done"] < 400
        assert all(not s.holders for s in read_cluster(store, lc.keys).workers.values())
    finally:
        store.close()


def test_rallypoint_run_on_a_cluster_started_with_up(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from orchestrator.local_cluster import LocalCluster as Recorded

    state = tmp_path / "state"
    rp("up", "--state-dir", str(state), "--workers", "2", "--spares", "1", "--devices-per-worker", "2",
       "--coordinators", "1")
    try:
        endpoints = ",".join(Recorded.load(state).endpoints)
        job = str(ROOT / "examples" / "rl_loop.py")
        on_cluster = rp("run", "--json", "--steps", "4", job, "--cluster", f"local@{endpoints}").stdout.splitlines()
        reference = rp("run", "--reference", "--json", "--steps", "4", job).stdout.splitlines()
        assert json.loads(on_cluster[-1])["state_digest"] == json.loads(reference[-1])["state_digest"]
        # After the job every device is free again.
        rows = [json.loads(x) for x in rp("workers", "--json", "--state-dir", str(state)).stdout.splitlines()]
        assert all(r["state"] == "spare" for r in rows), "devices outlived the job"
    finally:
        rp("down", "--state-dir", str(state))
