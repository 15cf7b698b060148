"""A multi-host slice inside its lead's runtime: the data-parallel example's one slice of 4 devices run as a
gang of 2 workers x 2 devices, its members on real worker daemons (docs/multihost.md).

The lead's runtime here runs in the test process (the executor does not place gangs yet): it loads
the job as a worker would, forms the slice's group through the members' workers, runs every step
and gives back the final state, which matches the in-process reference; a member's worker killed
mid-run fails the job naming that member, and no member process is left."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest

from rallypoint.basics.authz import WORKER
from rallypoint.client.compile import compile_program
from rallypoint.client.jobspec import job_spec
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.submit import JobError, resume, submit
from rallypoint.cluster.certs import issue
from rallypoint.cluster.local import LocalCluster
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.orchestrator.placement import SlicePlace, load_requests
from rallypoint.proto import codec
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.runtime import JobRuntime
from rallypoint.workers.transfer import PeerChannels
from tests.conftest import wait_until
from tests.examples import example
from tests.workers.test_slice_group import _gone

STEPS = 6


def _lead(lc: LocalCluster, compiled: Any, members: list[str], peers: PeerChannels) -> JobRuntime:
    store = lc.store()
    try:
        snap = wait_until(lambda: s if len((s := read_cluster(store, lc.keys)).workers) >= 3 else None, 30,
                          "the workers")
    finally:
        store.close()
    info = {w: snap.workers[w].info for w in members}
    spec = job_spec(compiled)
    lead = info[members[0]]
    req = load_requests(spec, {"dp": SlicePlace(lead.worker, lead.address, lead.incarnation, (0, 1, 2, 3))},
                        cluster=lc.keys.cluster, term=1)[lead.worker]
    sa = req.slices[0]
    del sa.devices[:]
    sa.devices.extend([0, 1])
    sa.members.extend(pb.GangMember(worker_id=w, address=info[w].address, incarnation=info[w].incarnation, devices=2)
                      for w in members)
    return JobRuntime(req, worker_id=lead.worker, devices=jax.devices()[:2], admit=lambda to: None,
                      incarnation=lambda: lead.incarnation, peers=peers)


def test_a_slice_of_4_devices_runs_as_a_gang_of_2_workers_and_a_lost_member_fails_it_by_name(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    lc = local_cluster(workers=3, spares=0, devices_per_worker=2, coordinators=1)
    assert lc.tls_dir is not None
    peers = PeerChannels(issue(lc.tls_dir, "gang-lead", role=WORKER, cluster=lc.keys.cluster))
    compiled = compile_program(example("data_parallel").build(steps=STEPS))
    reference = ReferenceExecutor(compiled).run()
    try:
        rt = _lead(lc, compiled, ["w0", "w1"], peers)
        try:
            assert [g.group.members[i].ready["devices"] for g in rt.gangs for i in (0, 1)] == [4, 4]
            rt.start()
            rt.grant(STEPS)
            assert rt.wait_finished(120), rt.error
            final = {v.state: [codec.from_tensor(t) for t in v.leaves] for v in rt.final_states()}
            members = rt.gangs[0].group.pids()
        finally:
            rt.stop()
        assert _gone(members, 10.0)
        # The reduction crosses processes through gloo: the same values, up to the order of the sum.
        for name, leaves in final.items():
            want = jax.tree_util.tree_leaves(reference.states[name])
            for got, w in zip(leaves, want, strict=True):
                np.testing.assert_allclose(got, np.asarray(w), rtol=1e-5, atol=1e-6)
        # A member's worker dies mid-run: the slice's group is lost and the job fails, naming the member.
        rt = _lead(lc, compiled, ["w0", "w2"], peers)
        try:
            rt.start()
            rt.grant(2)
            wait_until(lambda: rt.completed >= 2 or None, 60, "two steps")
            members = rt.gangs[0].group.pids()
            lc.signal("w2", signal.SIGKILL)
            rt.grant(STEPS)
            assert not rt.wait_finished(60)
            assert "member 1 of the slice's group is lost" in rt.error and "w2" in rt.error, rt.error
        finally:
            rt.stop()
        assert _gone(members, 10.0)
    finally:
        peers.close()


def test_the_executor_places_a_slice_larger_than_any_worker_as_a_gang_and_resume_continues_after_a_member_loss(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    lc = local_cluster(workers=3, spares=0, devices_per_worker=2, coordinators=1)
    compiled = compile_program(example("data_parallel").build(steps=STEPS, devices=4))  # no worker has 4
    whole = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=2)
    placed = _record(lc, compiled.program.name)["placement"]["dp"]
    assert [m["worker"] for m in placed["members"]] == ["w0", "w1"] and placed["worker"] == "w0", placed
    reference = ReferenceExecutor(compiled).run()
    for name, value in whole.states.items():
        for got, want in zip(jax.tree_util.tree_leaves(value), jax.tree_util.tree_leaves(reference.states[name]),
                             strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

    killed: list[int] = []

    def on_event(ev: pb.JobEvent) -> None:
        if ev.event == "step.done" and ev.step == 2 and not killed:
            killed.append(ev.step)
            lc.signal("w1", signal.SIGKILL)  # the second member's worker, not the one that drives the slice

    with pytest.raises(JobError) as failed:
        submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=2, on_event=on_event,
               new_run=True)
    assert "member 1 of the slice's group is lost" in str(failed.value) and "w1" in str(failed.value), failed.value
    _gone_from_cluster(lc, "w1")
    # Resumed from the newest cut on the workers left (a new gang, w0 and w2): bitwise the run without the loss.
    done = resume(compiled.program.name, endpoints=lc.endpoints, cluster=lc.keys.cluster)
    assert done["state_digest"] == whole.state_digest, done
    placed = _record(lc, compiled.program.name)["placement"]["dp"]
    assert [m["worker"] for m in placed["members"]] == ["w0", "w2"], placed
    # The worker that drives the slice dies: the job fails saying a recovery does not re-form the gang yet,
    # and resume continues it on the workers left; a lone worker of 2 devices holds no 4-device slice, so a new
    # worker joins first.
    lc.spawn("worker", "w3")
    killed.clear()

    def kill_lead(ev: pb.JobEvent) -> None:
        if ev.event == "step.done" and ev.step == 2 and not killed:
            killed.append(ev.step)
            lc.signal("w0", signal.SIGKILL)

    with pytest.raises(JobError) as failed:
        submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=2, on_event=kill_lead,
               new_run=True)
    assert "multi-host slice 'dp' lost the worker that drives it (w0)" in str(failed.value), failed.value
    _gone_from_cluster(lc, "w0")
    wait_until(lambda: _registered(lc, "w3") or None, 30, "w3 registered")
    done = resume(compiled.program.name, endpoints=lc.endpoints, cluster=lc.keys.cluster)
    assert done["state_digest"] == whole.state_digest, done


def _registered(lc: LocalCluster, worker: str) -> bool:
    store = lc.store()
    try:
        return worker in read_cluster(store, lc.keys).workers
    finally:
        store.close()


def _gone_from_cluster(lc: LocalCluster, worker: str) -> None:
    """The dead worker is fenced (its registration gone), so no new gang is leased on it."""
    wait_until(lambda: not _registered(lc, worker) or None, 30, f"{worker} fenced")


def _record(lc: LocalCluster, job: str) -> dict[str, Any]:
    store = lc.store()
    try:
        kv = store.get(lc.keys.job(job))
        assert kv is not None
        return kv.json()
    finally:
        store.close()
