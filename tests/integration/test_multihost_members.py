"""A multi-host slice's members on real worker daemons: started and relayed by each worker's ``Member`` call
(mutual TLS, a worker's role only), and lost with their worker (docs/multihost.md). The executor's use of
them, recovery included, is tests/integration/test_gang_runtime.py."""

from __future__ import annotations

import signal
from collections.abc import Callable

import grpc
import pytest

from rallypoint.basics.authz import WORKER
from rallypoint.basics.tls import channel as tls_channel
from rallypoint.cluster.certs import issue
from rallypoint.cluster.local import LocalCluster
from rallypoint.etcd.cluster_records import Holder
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc
from rallypoint.workers.gang.link import RemoteMember, form_on_workers
from rallypoint.workers.gang.group import GroupLost
from tests.conftest import read_events, wait_until
from tests.helpers.slice_group import W0, all_gone, run_steps, setup_group, train_step_bytes


def test_members_run_on_their_workers_only_for_a_worker_and_die_with_them(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    # Each worker keeps one member started ahead (--member-pool 1): the group below forms from those.
    lc = local_cluster(workers=2, spares=0, devices_per_worker=2, coordinators=1, member_pool=1)
    program = train_step_bytes()
    assert lc.tls_dir is not None
    driver = issue(lc.tls_dir, "slice-driver", role=WORKER, cluster=lc.keys.cluster)  # the lead worker's identity
    store = lc.store()
    try:
        snap = wait_until(lambda: s if len((s := read_cluster(store, lc.keys)).workers) == 2 else None, 30,
                          "two workers")
    finally:
        store.close()
    channels = {w: tls_channel(s.info.address, driver) for w, s in snap.workers.items()}

    def on(*workers: str) -> list[tuple[pb_grpc.WorkerRuntimeStub, pb.Identity]]:
        return [(pb_grpc.WorkerRuntimeStub(channels[w]),
                 pb.Identity(cluster=lc.keys.cluster, worker_id=w, incarnation=snap.workers[w].info.incarnation))
                for w in workers]

    try:
        # A client's certificate may not start members; a worker's settings are checked.
        client = tls_channel(snap.workers["w0"].info.address, lc.client_tls)
        with pytest.raises(grpc.RpcError) as denied:
            next(pb_grpc.WorkerRuntimeStub(client).Member(iter([pb.MemberChunk(start="{}")])))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        client.close()
        with pytest.raises(GroupLost, match="must be told the group's coordinator"):
            stub, to = on("w1")[0]
            RemoteMember(stub, to, {"processes": 2, "process": 1, "local_devices": 2})

        # A member starts only on devices the leader leased to the job and slice it names (tests/security/).
        with pytest.raises(GroupLost, match="leased to nobody"):
            form_on_workers(on("w0", "w1"), 2, request_timeout_s=30.0, device_ids=[[0, 1], [0, 1]], job="j",
                            slice_name="dp")
        store = lc.store()  # what the leader writes when it places the gang
        try:
            for w in ("w0", "w1"):
                for d in (0, 1):
                    store.put(lc.keys.lease(w, d), Holder(job="j", slice="dp", nonce="t", term=1).to_json())
        finally:
            store.close()

        # A group on two daemons trains; the second member's worker dies (SIGKILL): its member goes with it, the
        # group is lost naming it, and the abort ends the first member on its own worker.
        group = form_on_workers(on("w0", "w1"), 2, request_timeout_s=30.0, heartbeat_s=30,
                                device_ids=[[0, 1], [0, 1]], job="j", slice_name="dp")
        pooled = {w: [e["pid"] for e in read_events(lc.process(w).log, "member.pooled")] for w in ("w0", "w1")}
        for w in ("w0", "w1"):  # its member was the one started ahead, and another now waits in its place
            (started,) = read_events(lc.process(w).log, "member.started")
            assert started["pooled"] is True and started["pid"] == pooled[w][0] and len(pooled[w]) == 2, (w, pooled)
        try:
            setup_group(group, program)
            group.put("w", W0, "m", [])
            losses: list[float] = []
            run_steps(group, 0, 2, losses)
            members = group.pids()
            lc.signal("w1", signal.SIGKILL)
            with pytest.raises(GroupLost) as lost:
                run_steps(group, 2, 3, [])
            assert lost.value.member == 1 and "w1" in str(lost.value), str(lost.value)
        finally:
            group.abort()
        assert all_gone(members, 10.0), "a member outlived the lost group"
        assert all_gone(pooled["w1"], 10.0), "a member started ahead outlived its worker"
    finally:
        for c in channels.values():
            c.close()
