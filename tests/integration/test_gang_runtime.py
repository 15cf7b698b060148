"""Multi-host slices on a real cluster: one data-parallel slice of 4 devices, its weights and Adam's moments sharded
over them (tests/helpers/fsdp.py: FSDP), as a gang of 2 workers x 2 devices, its members on real worker
daemons (docs/multihost.md). Each member holds, saves and restores only its own shards of the state.

The executor places the gang and moves it whole off a drained member; a lost member (the lead killed here;
one that does not lead cut off the network on a host of its own, and killed in the multihost-kill chaos
scenario) is recovered as a unit, and the run ends bitwise equal to the run without the loss."""

from __future__ import annotations

import datetime
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from rallypoint.client.compile import compile_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.submission import submit
from rallypoint.chaos.network import partitionable_cluster
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.etcd.drains import request_drain
from rallypoint.proto import rallypoint_pb2 as pb
from tests.conftest import read_events
from rallypoint.workers.checkpoints.checksums import read_listing
from tests.helpers.cluster import job_record, snapshot
from tests.examples import example

fsdp = example("fsdp")
STEPS = 6
DRAIN_STEPS = 14
_BASELINE: list[str] = []  # the gang's fault-free digest (the same bits on any cluster of the same gang shape)


def test_the_executor_places_a_slice_larger_than_any_worker_as_a_gang_moves_it_whole_off_a_drained_member_and_recovers_it_when_its_lead_is_lost(  # noqa: E501
    local_cluster: Callable[..., LocalCluster],
) -> None:
    lc = local_cluster(workers=4, spares=0, devices_per_worker=2, coordinators=1)
    compiled = compile_program(fsdp.build(steps=STEPS, devices=4))  # no worker has 4
    cold = {"warm_spares": 0}  # no member processes started ahead but in the drained run, which checks them: each
    # costs a JAX import of CPU on a machine of 2 cores
    whole = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=2, **cold)
    placed = job_record(lc, compiled.program.name)["placement"]["dp"]
    assert [m["worker"] for m in placed["members"]] == ["w0", "w1"] and placed["worker"] == "w0", placed
    reference = ReferenceExecutor(compiled).run()
    for name, value in whole.states.items():
        for got, want in zip(jax.tree_util.tree_leaves(value), jax.tree_util.tree_leaves(reference.states[name]),
                             strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

    # A member that does not lead (w1) is drained after step 2: the gang moves whole, from a checkpoint at the
    # drain step (each member its shards), onto a new gang sharing no worker with the old one. Nothing is lost, so
    # nothing is fenced or replayed, and no recovery runs; the run ends bitwise equal. (A longer run, granted a
    # step at a time, so that the drain is taken up before every step is granted.)
    longer = compile_program(fsdp.build(steps=DRAIN_STEPS, devices=4))
    plain = submit(longer, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=2, window=1, new_run=True,
                   **cold)
    before = snapshot(lc)
    asked: list[int] = []

    def on_event(ev: pb.JobEvent) -> None:
        if ev.event == "step.done" and ev.step == 2 and not asked:
            store = lc.store()
            try:
                asked.append(request_drain(store, lc.keys, "w1", reason="operator", by="test").revision)
            finally:
                store.close()

    drain_run = _now()
    drained = submit(longer, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=2, window=1,
                     on_event=on_event, new_run=True)
    rec = drained.recovery
    assert drained.state_digest == plain.state_digest and rec["recoveries"] == [] and rec["failures"] == [], rec
    (d,) = rec["drains"]
    assert d["state"] == "done" and d["worker"] == "w1" and d["slices"] == ["dp"] and d["replayed_instances"] == 0, d
    moved = job_record(lc, longer.program.name)["placement"]["dp"]
    assert [m["worker"] for m in moved["members"]] == ["w2", "w3"] and d["moved"] == {"dp": "w2"}, (moved, d)
    after = snapshot(lc)
    assert all(after.workers[w].info.incarnation == before.workers[w].info.incarnation for w in before.workers)
    assert not after.workers["w1"].holders and not after.workers["w0"].holders, "the old gang's devices were kept"
    # The new gang's members read the drain step's checkpoint back, each its own shards, checked against the
    # digests the old gang's members wrote (workers/gang/checkpoint.py).
    # They read it from memory: before unloading, the old gang's members pushed the copies of their shards of the
    # drain step's commit to their own workers and their parts' holders (workers/gang/replicas.py).
    # The new gang's workers were its warm spares: each kept a member process started for the job's gang (with its
    # imports done), and the drain's new group took them (orchestrator/job/warm.py).
    for w in ("w2", "w3"):
        started_there = [e for e in read_events(lc.process(w).log, "member.started") if e["ts"] > drain_run]
        assert started_there and started_there[0]["pooled"] is True, (w, started_there)
    restored = read_events(lc.process("w2").log, "checkpoint.restored_on_group")
    assert [(e["step"], e["checked"], e["members"], e.get("tier")) for e in restored] == \
        [(d["step"], "shards", 2, "memory")], restored
    store = lc.store()
    try:
        store.delete(lc.keys.drain("w1"))  # answered: the next runs may use w1 again
    finally:
        store.close()

    def run_killing(which: int) -> tuple[Any, list[str]]:
        """A new run of the job whose gang loses member ``which`` (its worker SIGKILLed) after step 2."""
        killed: list[str] = []

        def on_event(ev: pb.JobEvent) -> None:
            if ev.event == "step.done" and ev.step == 2 and not killed:
                members = [m["worker"] for m in job_record(lc, compiled.program.name)["placement"]["dp"]["members"]]
                killed.append(members[which])
                at.append(_now())
                lc.signal(members[which], signal.SIGKILL)

        result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=2,
                        on_event=on_event, new_run=True, **cold)
        return result, killed

    # The lead is killed: the gang is lost as a unit, formed anew on the workers left, restored from the cut and
    # replayed; the run ends bitwise equal to the one without the loss. (A member that does not lead: the
    # multihost-kill chaos scenario, and the partition below.)
    _BASELINE.append(whole.state_digest)
    started, at = _now(), []
    result, killed = run_killing(0)
    assert killed and result.state_digest == whole.state_digest, result.recovery
    assert len(result.recovery["recoveries"]) == 1, result.recovery
    members = [m["worker"] for m in job_record(lc, compiled.program.name)["placement"]["dp"]["members"]]
    assert len(members) == 2 and killed[0] not in members, (killed, members)
    # Its checkpoints: each member saved its own shards, one commit for the slice over their digests
    # (workers/gang/checkpoint.py), nothing gathered on the lead.
    committed = [e for w in ("w0", "w1", "w2", "w3") for e in read_events(lc.process(w).log, "checkpoint.committed")]
    assert committed and all(e["checksum"].startswith("sha256-shards:") for e in committed), committed
    # The state is sharded (FSDP over the gang's 4 devices): each checkpoint lists each weight in four quarters of
    # its columns, each saved by the member holding it (a replicated state would list each leaf once, whole).
    kept = [Path(e["path"]) for e in committed if Path(e["path"]).exists()]  # retention deleted the older ones
    assert kept, committed
    for path in kept:
        w1 = [x for x in read_listing(path) if x["state"] == "params" and x["leaf"] == 0]
        assert sorted(x["index"][1] for x in w1) == [[0, 16], [16, 32], [32, 48], [48, 64]], (path, w1)
    # The new gang restored from memory: each part's copy survived the lead's host on its other holder (the lead's
    # part on its holder, member 1's on its own worker). A restore that finds no copy reads the disk and says why.
    # (Whether the copies of the cut were all pushed before the kill depends on when it came: a copy goes once its
    # step commits. The drain above restores from memory every time.)
    new_lead = lc.process(members[0]).log
    restores = [e for e in read_events(new_lead, "checkpoint.restored_on_group") if e["ts"] > at[0]]
    for r in restores:
        missed = [e for e in read_events(new_lead, "replica.unavailable") if e["ts"] > at[0] and e["step"] == r["step"]]
        if _copied(lc, r["step"], 2, started, r["ts"], killed[0]):
            assert (r.get("tier"), missed) == ("memory", []), (r, missed)
        else:
            assert r.get("tier") is None and missed, (r, missed)

    # A gang's output to a slice on another worker goes shard by shard: each member sends the shards it holds from
    # its own host and the consumer's worker puts the pieces together (workers/gang/pieces.py); the lead never holds it.
    out = compile_program(_gang_to_head(STEPS))
    flowed = submit(out, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=2, new_run=True, **cold)
    want = ReferenceExecutor(out).run()
    np.testing.assert_allclose(np.asarray(flowed.states["acc"]), np.asarray(want.states["acc"]), rtol=1e-6)
    placed = job_record(lc, out.program.name)["placement"]
    head, gang = placed["head"]["worker"], [m["worker"] for m in placed["dp"]["members"]]
    assert head not in gang, placed
    sent = [e for w in gang for e in read_events(lc.process(w).log, "value.sent") if e["ts"] > started]
    assert sorted({e["member"] for e in sent}) == [0, 1] and all(e["pieces"] == 2 for e in sent), sent
    assert len(sent) == 2 * STEPS, sent  # each member, each step: its half of the rows (2 shards), nothing gathered


def _gang_to_head(steps: int) -> Any:
    """A gang (4 devices on workers of 2) whose per-step output, sharded over its batch, feeds a slice elsewhere."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from rallypoint.client import Program

    prog = Program("gang-to-head", steps=steps, checkpoint_every=2)
    dp, head = prog.slice("dp", devices=4, mesh_axes=("data",)), prog.slice("head", devices=2)
    w = prog.state("w", slice=dp, init=lambda: jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(8, 4))
    acc = prog.state("acc", slice=head, init=lambda: jnp.zeros((4,), jnp.float32))
    batch = prog.source("batch", lambda step, mb: {"x": jnp.arange(64, dtype=jnp.float32).reshape(8, 8) + step},
                        slice=dp, per="step", outputs=("x",), shardings={"x": P("data")})
    fwd = prog.node("fwd", lambda w, x: (jnp.tanh(x @ w), w * 0.99), slice=dp, inputs={"w": w, "x": batch["x"]},
                    outputs=("h", "w"), updates={"w": w}, shardings={"x": P("data"), "h": P("data")})
    prog.node("sum", lambda acc, h: acc + h.sum(axis=0), slice=head, inputs={"acc": acc, "h": fwd["h"]},
              outputs=("acc",), updates={"acc": acc})
    return prog


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _copied(lc: LocalCluster, step: int, parts: int, since: str, until: str, lost: str) -> bool:
    """Whether a copy of every part of the commit at ``step`` was stored on a worker other than ``lost`` between
    ``since`` and ``until`` (workers/gang/replicas.py)."""
    stored = {e["slice"] for w in ("w0", "w1", "w2", "w3") if w != lost
              for e in read_events(lc.process(w).log, "replica.stored") if since < e["ts"] < until and e["step"] == step}
    return stored >= {f"dp#{j}" for j in range(parts)}


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")
def test_on_hosts_of_their_own_a_gang_loses_a_partitioned_member_and_ends_bitwise_equal(
    tmp_path: Path, compile_cache: Path,
) -> None:
    # Every worker in its own network namespace with its own address (etcd and the coordinator on the bridge's
    # host address); the workers share nothing but the checkpoint directory.
    config = LocalClusterConfig(state_dir=tmp_path / "cluster", workers=3, spares=0, devices_per_worker=2,
                                coordinators=1, lease_ttl_s=2, compile_cache_dir=compile_cache)
    with partitionable_cluster(config, mode="netns") as (lc, control):
        compiled = compile_program(fsdp.build(steps=STEPS, devices=4))
        if not _BASELINE:  # a gang of the same shape computes the same bits on any cluster: run once per module
            _BASELINE.append(submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster,
                                    checkpoint_every=2, warm_spares=0).state_digest)
        store = lc.store()
        try:
            snap = read_cluster(store, lc.keys)
        finally:
            store.close()
        addresses = [*lc.endpoints, *(a for s in snap.workers.values() for a in (s.info.address, s.info.data_address))]
        assert not [a for a in addresses if a.startswith(("127.", "localhost"))], addresses
        result = _run_partitioning(lc, control, compiled)
        store = lc.store()
        try:
            after = read_cluster(store, lc.keys)
        finally:
            store.close()
        started = read_events(lc.process("w0").log, "member.started")
        assert started and not started[0]["coordinator"].startswith("127."), started  # the group's coordinator

        assert result.state_digest == _BASELINE[0], result.recovery
        members = [m["worker"] for m in job_record(lc, compiled.program.name)["placement"]["dp"]["members"]]
        assert "w1" not in members and len(members) == 2, members
        # The lead (w0) is alive: only the job's runtime on it ended, never the worker, so it kept its
        # incarnation (its other jobs would have gone on) and could lead the new gang.
        assert after.workers["w0"].info.incarnation == snap.workers["w0"].info.incarnation
        assert members[0] == "w0", members


def _run_partitioning(lc: LocalCluster, control: Any, compiled: Any) -> Any:
    """A run of the job whose second member (w1) is cut off the network after step 2, then healed."""
    cut: list[str] = []

    def on_event(ev: pb.JobEvent) -> None:
        if ev.event == "step.done" and ev.step == 2 and not cut:
            cut.append("w1")
            control.partition("w1")  # the second member's cable pulled: its collectives hang

    try:
        result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=2,
                        on_event=on_event, new_run=bool(_record_or_none(lc, compiled.program.name)), warm_spares=0)
    finally:
        if cut:
            control.heal("w1")
    assert cut, "the partition never fired"
    return result


def _record_or_none(lc: LocalCluster, job: str) -> dict[str, Any] | None:
    store = lc.store()
    try:
        kv = store.get(lc.keys.job(job))
        return kv.json() if kv is not None else None
    finally:
        store.close()
