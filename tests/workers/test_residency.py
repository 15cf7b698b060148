"""Values stay on the slice's devices: proved by type and by count (workers/residency.py).

On CPU, JAX's transfer guards do not see a NumPy view of a host-resident array, so these
tests look at what the runtime holds (``jax.Array``s on the slice's devices, laid out as
the programs take them) and at the bytes it counts copying between host and device, by
purpose: a value that stays on one worker is never copied; one that crosses to another
worker leaves the device once and arrives on it once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from rallypoint.client.reference import state_digest
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.recovery.load_plan import instances_per_step
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers import residency
from rallypoint.workers.residency import Copies, HostCopy, place, to_host
from rallypoint.workers.runtime.runtime import JobRuntime
from tests.conftest import wait_until
from tests.helpers.runtime import Job, PLACEMENTS, compiled_and_reference, load, started_workers


def _runtime(job: Job, wid: str) -> JobRuntime:
    [rt] = [rt for rt in job.workers[wid].service.runtimes() if rt.job == job.spec.job]
    return rt


def _slice_devices(wid: str, slice_name: str, name: str) -> set[Any]:
    devs = jax.devices()[4 * ("wA", "wB").index(wid): 4 * ("wA", "wB").index(wid) + 4]
    return {devs[i] for i in PLACEMENTS[name][slice_name][1]}


def _nbytes(avals: Any) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(avals))


def _run_to_end(job: Job) -> None:
    """Grant every step and wait for every instance (checkpoint commits are events too: not counted)."""
    job.grant(job.spec.steps)
    want = sum(instances_per_step(job.spec, s) for s in range(job.spec.steps))
    wait_until(lambda: len([ev for ev in job.done() if ev.node]) >= want, 60, f"{want} instances")
    assert [ev.error for ev in job.done() if ev.error] == []


def _expected_transfers(job: Job) -> tuple[int, int]:
    """Bytes the pushes across workers must copy off the devices (once per value) and onto them (once per
    consumer), from the routes: ``(d2h, h2d)`` over the whole run."""
    spec, steps = job.spec, job.spec.steps
    nodes = {n.name: n for n in spec.nodes}
    m = max(int(spec.microbatches), 1)
    d2h = h2d = 0
    for wid, req in job.requests.items():
        assert not [r for r in req.routes if r.state and r.worker_id != wid]  # no state crosses in these placements
        remote = [r for r in req.routes if r.node and r.worker_id != wid]
        for node, output in sorted({(r.node, r.output) for r in remote}):
            n = nodes[node]
            instances = len([s for s in range(steps) if s % max(n.every, 1) == 0]) * (m if n.per_microbatch else 1)
            size = _nbytes(job.compiled.nodes[node].out_avals[output])
            d2h += size * instances
            h2d += size * instances * len([r for r in remote if (r.node, r.output) == (node, output)])
    return d2h, h2d


def test_states_outputs_and_delivered_values_stay_on_the_slices_devices_with_their_shardings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # pipeline_mlp alternates its stages between wA and wB: every stage-to-stage value crosses workers. Its values
    # are small: with the threshold at 0 every received value is placed as a large one is (a small one is left for
    # the call to copy on, residency.SMALL_VALUE_BYTES).
    monkeypatch.setattr(residency, "SMALL_VALUE_BYTES", 0)
    with started_workers() as ws:
        job = load("pipeline_mlp", ws)
        job.grant(2)
        job.wait_instances(2)
        # wA runs step 2 as far as it can while wB may not: wA's values for wB's step-2 instances wait in wB's inbox
        wa = ws["wA"]
        wa.stub.RunSteps(pb.RunStepsRequest(to=wa.to(), job=job.spec.job, until_step=3), timeout=10)
        wait_until(lambda: len(_runtime(job, "wB").inputs._inbox) > 0, 30, "values waiting in wB's inbox")
        compiled = job.compiled
        seen = waiting = 0
        for wid in job.requests:
            rt = _runtime(job, wid)
            with rt.control.cv:
                for name, sv in rt.states.items():
                    slice_name = compiled.states[name].slice
                    value = sv.at(2)
                    assert value is not None
                    mesh_devices = _slice_devices(wid, slice_name, "pipeline_mlp")
                    for leaf in value:
                        assert isinstance(leaf, jax.Array), (name, type(leaf))
                        assert leaf.sharding.device_set == mesh_devices
                    seen += 1
                # what waits for a consumer (the next steps' inputs, delivered from the other worker) is on the
                # consumer's devices already, laid out as its program takes it
                for (node, arg, _step, _mb), (leaves, _uses) in rt.inputs._inbox._values.items():
                    n = rt.nodes[node]
                    whole, delivered = rt.inputs._shardings(n, arg)
                    for leaf, s in zip(leaves, delivered, strict=True):
                        assert isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(s, leaf.ndim)
                        waiting += 1
                # a logged value is held once: on the device until its push copied it off, then as that host copy
                with rt.outlog._lock:
                    logged = list(rt.outlog._entries.values())
                for e in logged:
                    assert isinstance(e.leaves, HostCopy)
                    assert e.leaves.ready != e.leaves.on_device
        assert seen == len(compiled.states) and waiting > 0
        job.grant(job.spec.steps)
        job.wait_instances(job.spec.steps)
        job.unload()


def test_a_steady_state_copies_only_what_crosses_workers_and_each_value_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(residency, "SMALL_VALUE_BYTES", 0)  # each received value placed on arrival, as a large one
    commits: list[CheckpointCommit] = []
    _, ref = compiled_and_reference("pipeline_mlp")
    _, dp_ref = compiled_and_reference("data_parallel")
    with started_workers(commit_factory=lambda: commits.append) as ws:
        # one worker: data_parallel on wB's 4 devices, checkpointing every 2 of its 4 steps
        dp = load("data_parallel", ws, checkpoint_every=2, checkpoint_dir=str(tmp_path / "dp"))
        _run_to_end(dp)
        wait_until(lambda: len(commits) == 2, 60, "the data_parallel checkpoints at step 2 and the final cut at 4")
        rt = _runtime(dp, "wB")
        copies = rt.copies
        assert copies.bytes("d2h", "transfer") == 0 and copies.bytes("h2d", "transfer") == 0
        assert copies.bytes("d2h", "log_spill") == 0 and copies.bytes("h2d", "checkpoint") == 0
        state_bytes = sum(_nbytes(s.aval) for s in dp.compiled.states.values())
        assert copies.bytes("d2h", "checkpoint") == 2 * state_bytes  # two saves (2, 4), each state copied off once
        instances = sum(instances_per_step(dp.spec, s) for s in range(dp.spec.steps))
        assert 0 < copies.bytes("h2d", "step") <= 8 * instances  # the step numbers sources take: 4 bytes each
        assert state_digest(dp.fetch_states()) == dp_ref.state_digest
        assert copies.bytes("d2h", "fetch") == state_bytes
        dp.unload()

        # two workers: the pipeline's stages alternate, so each stage's output crosses to the other worker
        job = load("pipeline_mlp", ws, checkpoint_every=2, checkpoint_dir=str(tmp_path / "pipe"))
        _run_to_end(job)
        runtimes = {wid: _runtime(job, wid) for wid in job.requests}
        for rt in runtimes.values():
            assert rt.flush(30)
        d2h, h2d = _expected_transfers(job)
        assert d2h > 0
        assert sum(rt.copies.bytes("d2h", "transfer") for rt in runtimes.values()) == d2h
        assert sum(rt.copies.bytes("h2d", "transfer") for rt in runtimes.values()) == h2d
        assert sum(rt.copies.bytes("d2h", "log_spill") for rt in runtimes.values()) == 0
        assert state_digest(job.fetch_states()) == ref.state_digest
        job.unload()


def test_copies_are_counted_by_direction_and_purpose_and_a_host_copy_is_made_once() -> None:
    copies = Copies("j")
    dev = jax.devices()[0]
    x = jax.device_put(np.arange(6, dtype=np.float32), dev)
    hc = HostCopy([x], copies)
    assert hc.on_device and not hc.ready
    a, b = hc.get(), hc.get("log_spill")
    assert a is b and np.array_equal(a[0], np.arange(6, dtype=np.float32))
    assert copies.snapshot() == {"d2h/transfer": 24} and hc.ready and not hc.on_device
    # host arrays cost nothing to read; putting them on a device is one h2d copy
    assert to_host([np.zeros(3)], copies, "metric")[0].shape == (3,) and copies.bytes("d2h", "metric") == 0
    s = jax.sharding.SingleDeviceSharding(dev)
    [y] = place([np.ones(4, np.int32)], [s], copies, "transfer")
    assert isinstance(y, jax.Array) and copies.bytes("h2d", "transfer") == 16
    [z] = place([y], [s], copies, "transfer")  # already there: the same array, no copy
    small = np.ones(4, np.int32)
    assert place([small], [s], copies, "transfer", small="later")[0] is small  # left for the taker: not counted
    assert copies.bytes("h2d") == 16
    assert place([small], [s], copies, "transfer", small="call")[0] is small  # the call copies it on: counted
    assert copies.bytes("h2d") == 32 and copies.count("h2d") == 2
    assert z is y
    other = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    [w] = place([y], [other], copies, "transfer")  # device to device: no host copy counted
    assert w.sharding.device_set == {jax.devices()[1]} and copies.count("h2d") == 2
    with pytest.raises(ValueError, match="lunch"):
        copies.add("d2h", "lunch", 1)


def test_place_keeps_equivalent_layouts_and_moves_the_rest_with_the_layout_answers_kept() -> None:
    """``same_layout`` answers as ``Sharding.is_equivalent_to`` does, asked again or not; ``place`` moves only
    what is laid out otherwise."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    rep2 = NamedSharding(mesh, P(None))  # another object, the same layout
    for _ in range(2):
        assert residency.same_layout(rep, rep2, 1) and residency.same_layout(rep, rep, 2)
        assert not residency.same_layout(rep, split, 1) and not residency.same_layout(split, rep, 1)
    x = jax.device_put(np.arange(4.0), rep)
    kept, moved = place([x, x], [rep2, split], None, "transfer")
    assert kept is x and moved.sharding == split
    np.testing.assert_array_equal(np.asarray(moved), np.arange(4.0))
