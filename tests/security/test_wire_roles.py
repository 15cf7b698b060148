"""A stolen worker or client certificate on the real wire: what it may not move, start or stop (docs/security.md,
"Terms, gang members, formation deadlines and job owners").

One secure local cluster (etcd with TLS and a user per role, one coordinator, two workers of one device) serves the
module. Certificates of each role from the cluster's CA stand in for a thief's: the test plays the attacker.

* A peer's fencing term is checked, never adopted: a worker certificate sending ``term=2**62`` fences nobody out.
* A gang member starts only on devices the leader leased to the job and slice it names, and stays in that job's
  folder and values.
* A client cancels only the jobs it submitted; who stopped a job is the certificate's name, not the client's word.
* A gang member's worker hung while a gang forms: the load fails by its deadline (or at once on an unload), and a
  later load of the job on that worker is not refused as "already loaded".
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from rallypoint.basics.tls import TlsConfig, channel
from rallypoint.cluster.certs import issue
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig, is_running
from rallypoint.etcd.cluster_records import Holder
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc
from rallypoint.workers.gang.group import GroupLost
from rallypoint.workers.gang.link import RemoteMember
from tests.conftest import read_events, wait_until

pytestmark = pytest.mark.processes
HUGE = 2**62


@pytest.fixture(scope="module")
def lc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cfg = LocalClusterConfig(state_dir=tmp_path_factory.mktemp("wire"), workers=2, spares=0, devices_per_worker=1,
                             coordinators=1, lease_ttl_s=10)
    cluster = LocalCluster.start(cfg)
    try:
        store = cluster.store()
        try:
            wait_until(lambda: store.get(cluster.keys.leader), 30, "a leader elected")
            wait_until(lambda: len(read_cluster(store, cluster.keys).workers) == 2, 30, "two workers")
        finally:
            store.close()
        yield cluster
    finally:
        cluster.stop()
        assert not [p for p in cluster.processes if is_running(p)]


@pytest.fixture(scope="module")
def certs(lc: LocalCluster) -> dict[str, TlsConfig]:
    """A certificate of each role (and two clients) from the cluster's own CA: what a thief of one holds."""
    assert lc.tls_dir is not None
    made = {r: issue(lc.tls_dir, f"thief-{r}", role=r, cluster=lc.keys.cluster)
            for r in ("worker", "coordinator", "operator")}
    made["alice"] = issue(lc.tls_dir, "alice", role="client", cluster=lc.keys.cluster)
    made["mallory"] = issue(lc.tls_dir, "mallory", role="client", cluster=lc.keys.cluster)
    return made


def read(lc: LocalCluster, key: str) -> Any:
    """The key-value at ``key`` now (None: no such key)."""
    store = lc.store()
    try:
        return store.get(key)
    finally:
        store.close()


def worker(lc: LocalCluster, name: str) -> tuple[str, int]:
    """The address and incarnation of worker ``name`` now."""
    kv = read(lc, lc.keys.worker(name))
    assert kv is not None
    return kv.json()["address"], kv.create_revision


def registered(lc: LocalCluster, name: str) -> bool:
    """Whether worker ``name`` has a registration now."""
    return read(lc, lc.keys.worker(name)) is not None


def leader_term(lc: LocalCluster) -> int:
    kv = read(lc, lc.keys.leader)
    assert kv is not None
    return kv.create_revision


def to(lc: LocalCluster, name: str, **more: Any) -> pb.Identity:
    return pb.Identity(cluster=lc.keys.cluster, worker_id=name, incarnation=worker(lc, name)[1], **more)


def runtime(lc: LocalCluster, name: str, tls: TlsConfig) -> tuple[pb_grpc.WorkerRuntimeStub, grpc.Channel]:
    ch = channel(worker(lc, name)[0], tls)
    return pb_grpc.WorkerRuntimeStub(ch), ch


def put_leases(lc: LocalCluster, name: str, job: str, slice_name: str, devices: list[int], run_dir: str = "") -> None:
    """What the leader writes when it places a gang member: the device leases (and the job's record)."""
    store = lc.store()  # the operator's etcd user (the embedded cluster's client)
    try:
        for d in devices:
            store.put(lc.keys.lease(name, d), Holder(job=job, slice=slice_name, nonce="t", term=1).to_json())
        if run_dir:
            store.put(lc.keys.job(job), json.dumps({"job": job, "state": "running", "run_dir": run_dir}))
    finally:
        store.close()


def drop_leases(lc: LocalCluster, name: str, job: str) -> None:
    store = lc.store()
    try:
        store.delete(lc.keys.worker_leases(name), prefix=True)
        store.delete(lc.keys.job(job))
    finally:
        store.close()


# -- 1. the fencing term ---------------------------------------------------------------------------------------


def test_a_peers_huge_term_is_checked_never_adopted_so_the_leaders_term_still_leads(
        lc: LocalCluster, certs: dict[str, TlsConfig]) -> None:
    stub, ch = runtime(lc, "w0", certs["worker"])
    try:  # a stolen worker certificate sends the largest term it can on each peer call it may make
        with pytest.raises(grpc.RpcError) as fetched:
            next(stub.FetchReplica(pb.FetchReplicaRequest(to=to(lc, "w0", term=HUGE), job="j", slice="s", step=1),
                                   timeout=5))
        assert fetched.value.code() is grpc.StatusCode.NOT_FOUND  # admitted as a peer: it holds no such copy
        with pytest.raises(grpc.RpcError) as pushed:
            stub.PushReplica(iter([pb.ReplicaChunk(header=pb.ReplicaHeader(to=to(lc, "w0", term=HUGE), job="j"))]),
                             timeout=5)
        assert pushed.value.code() is not grpc.StatusCode.PERMISSION_DENIED
    finally:
        ch.close()
    term = leader_term(lc)
    for role in ("coordinator", "operator"):  # the real leader's term (and an operator's health check) still pass
        ch = channel(worker(lc, "w0")[0], certs[role])
        try:
            ping = pb_grpc.WorkerStub(ch).Ping(pb.PingRequest(to=to(lc, "w0", term=term)), timeout=5)
        finally:
            ch.close()
        assert ping.worker_id == "w0" and ping.state == "serving", role
    # a peer's term below the newest one the leader sent is refused (the check holds; only the raise is the leader's)
    stub, ch = runtime(lc, "w0", certs["worker"])
    try:
        with pytest.raises(grpc.RpcError) as stale:
            next(stub.FetchReplica(pb.FetchReplicaRequest(to=to(lc, "w0", term=term - 1), job="j", slice="s", step=1),
                                   timeout=5))
        assert stale.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "term" in stale.value.details()
    finally:
        ch.close()


# -- 2. gang members -------------------------------------------------------------------------------------------


def member_settings(**more: Any) -> dict[str, Any]:
    return {"processes": 1, "process": 0, "local_devices": 1, "init_timeout_s": 30, **more}


def test_a_member_starts_only_on_devices_the_leader_leased_to_its_job_and_stays_in_that_jobs_folder(
        lc: LocalCluster, certs: dict[str, TlsConfig], tmp_path: Any) -> None:
    stub, ch = runtime(lc, "w0", certs["worker"])
    started = len(read_events(lc.process("w0").log, "member.started"))
    try:
        for settings in (member_settings(), member_settings(device_ids=[0], job="loot", slice="s")):
            with pytest.raises(GroupLost) as refused:  # no lease names it: nothing starts
                RemoteMember(stub, to(lc, "w0"), settings)
            assert "placed no such gang member" in str(refused.value) or "must name its job" in str(refused.value)
        assert len(read_events(lc.process("w0").log, "member.started")) == started

        # Leased by "the leader" (the test writes what it would): the member starts, bound to the job's folder.
        job_dir = tmp_path / "ckpt" / "loot"
        put_leases(lc, "w0", "loot", "s", [0], run_dir=str(job_dir / "run1"))
        m = RemoteMember(stub, to(lc, "w0"), member_settings(device_ids=[0], job="loot", slice="s"))
        try:
            header, _ = m.receive(time.monotonic() + 60, "joining")
            assert header.get("ready"), header
            outside = tmp_path / "elsewhere"
            for request in ({"op": "save", "dir": str(outside), "tree": {}},
                            {"op": "restore", "dir": str(job_dir / ".." / ".." / "elsewhere"), "tree": {}},
                            {"op": "send", "address": "127.0.0.1:1", "values": [],
                             "transfer": _transfer_of("another-job")},
                            {"op": "restore_parts", "job": "another-job", "tree": {}}):
                m.send(request)
                answer, _ = m.receive(time.monotonic() + 30, request["op"])
                assert "refused" in answer.get("error", ""), (request["op"], answer)
            assert not outside.exists()
        finally:
            m.kill()
    finally:
        ch.close()
        drop_leases(lc, "w0", "loot")


def _transfer_of(job: str) -> str:
    import base64

    return base64.b64encode(pb.TransferHeader(job=job).SerializeToString()).decode()


# -- Extra: job owners -----------------------------------------------------------------------------------------


def _submit(lc: LocalCluster, tls: TlsConfig, job: str) -> None:
    """Submit a long counter job with ``tls``'s certificate; returns once it started (its record is written)."""
    from rallypoint.client.compile import compile_program
    from rallypoint.client.jobspec import job_spec
    from tests.helpers.cluster import counter_job

    spec = job_spec(compile_program(counter_job(1_000_000, name=job, checkpoint_every=1_000_000)))
    spec.submit_id = "wire-" + job
    ch = channel(_leader_address(lc), tls)
    try:
        events = pb_grpc.CoordinatorStub(ch).SubmitJob(spec, timeout=30)
        next(events)  # the first event: the job is started (its record is written)
    finally:
        ch.close()


def _leader_address(lc: LocalCluster) -> str:
    kv = read(lc, lc.keys.leader)
    assert kv is not None
    return kv.json()["address"]


def _cancel(lc: LocalCluster, tls: TlsConfig, job: str, by: str) -> pb.JobControlReply:
    ch = channel(_leader_address(lc), tls)
    try:
        return pb_grpc.CoordinatorStub(ch).CancelJob(pb.JobControlRequest(job=job, by=by, reason="test"), timeout=10)
    finally:
        ch.close()


def test_a_client_cancels_only_its_own_job_and_the_record_names_the_certificates_not_the_clients_word(
        lc: LocalCluster, certs: dict[str, TlsConfig]) -> None:
    _submit(lc, certs["alice"], "owned")
    store = lc.store()
    try:
        record = wait_until(lambda: (kv := store.get(lc.keys.job("owned"))) and kv.json(), 30, "the job's record")
        assert record["owner"] == "client:alice", record
        with pytest.raises(grpc.RpcError) as denied:  # another client, claiming to be alice
            _cancel(lc, certs["mallory"], "owned", by="client:alice")
        assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED, denied.value.details()
        assert "client:alice" in denied.value.details() and "client:mallory" in denied.value.details()
        assert store.get(lc.keys.control("owned")) is None  # nothing was asked of the job
        reply = _cancel(lc, certs["alice"], "owned", by="the operator on call")
        assert "cancel" in reply.message
        asked = wait_until(lambda: store.get(lc.keys.control("owned")), 10, "the cancel kept")
        assert json.loads(asked.value)["by"] == "client:alice"  # the certificate's name, not the client's word
        wait_until(lambda: (kv := store.get(lc.keys.job("owned"))) and kv.json().get("state") == "cancelled", 30,
                   "the job cancelled")
    finally:
        store.close()


# -- 6. a gang member's worker hung while the gang forms ---------------------------------------------------------


def _gang_load(lc: LocalCluster, job: str) -> pb.LoadJobRequest:
    members = [pb.GangMember(worker_id=w, address=worker(lc, w)[0], incarnation=worker(lc, w)[1], devices=1,
                             device_ids=[0]) for w in ("w0", "w1")]
    return pb.LoadJobRequest(to=to(lc, "w0", term=leader_term(lc)), job=job, steps=1, slices=[
        pb.SliceAssignment(slice="g", devices=[0], mesh_shape=[2], mesh_axes=["d"], members=members)])


def test_a_gang_forming_on_a_hung_worker_fails_by_its_deadline_an_unload_ends_it_and_a_later_load_is_not_blocked(
        lc: LocalCluster, certs: dict[str, TlsConfig]) -> None:
    # The worker's side of formation: a Member call to a SIGSTOPped worker gives up by its start deadline.
    put_leases(lc, "w1", "hung", "g", [0])
    put_leases(lc, "w0", "hung", "g", [0])
    stub1, ch1 = runtime(lc, "w1", certs["worker"])
    driver, ch0 = runtime(lc, "w0", certs["coordinator"])
    request, w1 = _gang_load(lc, "hung"), to(lc, "w1")  # the leader may fence w1 while it is stopped
    lc.signal("w1", signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(GroupLost, match="no answer within 2 s"):
            RemoteMember(stub1, w1, member_settings(device_ids=[0], job="hung", slice="g"),
                         start_timeout_s=2)
        assert time.monotonic() - t0 < 10

        started = len(read_events(lc.process("w0").log, "member.started"))
        # The leader's LoadJob of a gang with w1 hung: an UnloadJob ends the load under way at once ...
        load = driver.LoadJob.future(request, timeout=60)
        wait_until(lambda: len(read_events(lc.process("w0").log, "member.started")) > started, 30,
                   "member 0 started on w0")
        driver.UnloadJob(pb.UnloadJobRequest(to=to(lc, "w0", term=leader_term(lc)), job="hung"), timeout=5)
        with pytest.raises(grpc.RpcError) as ended:
            load.result(timeout=15)
        assert "cancelled" in ended.value.details() or "unloaded" in ended.value.details(), ended.value.details()
    finally:
        lc.signal("w1", signal.SIGCONT)
        ch1.close()
    try:
        # ... and a later load of the job on that worker is not refused as loaded: it goes as far as its leases
        # (gone now, so member 0 is refused at once).
        drop_leases(lc, "w0", "hung")
        wait_until(lambda: registered(lc, "w1"), 60, "w1 registered again after its SIGSTOP (its lease may have lapsed)")
        with pytest.raises(grpc.RpcError) as later:
            driver.LoadJob(_gang_load(lc, "hung"), timeout=30)
        assert "already loaded" not in later.value.details() and "leased to nobody" in later.value.details(), \
            later.value.details()
    finally:
        drop_leases(lc, "w1", "hung")
        ch0.close()
