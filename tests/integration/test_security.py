"""mTLS, roles and etcd auth on a real local cluster: who is refused, and what malformed or stale requests change.

One cluster (real etcd with TLS and a user per role, a leading and a standby coordinator, one worker) serves
every test of this module; each test ends by checking the cluster is as it found it (same processes, same
worker incarnation, no job) and still serves a valid peer. Certificates of each role, signed by the cluster's
CA, stand in for a stolen worker certificate, a client's and a coordinator's.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rallypoint.basics.errors import ConfigError
from rallypoint.cluster.certs import issue, make_certs
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig, is_running
from rallypoint.basics.errors import StoreError
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.basics.tls import TlsConfig, channel
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc
from rallypoint.workers.dataplane import MAGIC, DataPlaneClient, DataPlaneError, Status
from tests.conftest import wait_until

WORKER_METHODS = ["/rallypoint.v1.Worker/Ping", "/rallypoint.v1.WorkerRuntime/LoadJob",
                  "/rallypoint.v1.WorkerRuntime/RunSteps", "/rallypoint.v1.WorkerRuntime/UnloadJob",
                  "/rallypoint.v1.WorkerRuntime/Rewire"]
COORDINATOR_METHODS = ["/rallypoint.v1.Coordinator/SubmitJob", "/rallypoint.v1.Coordinator/ResumeJob",
                       "/rallypoint.v1.Coordinator/WatchJob"]


@pytest.fixture(scope="module")
def lc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cfg = LocalClusterConfig(state_dir=tmp_path_factory.mktemp("secure"), workers=1, spares=0, devices_per_worker=1,
                             coordinators=2, lease_ttl_s=2)
    cluster = LocalCluster.start(cfg)
    try:
        store = cluster.store()  # every test reads the leader's term: wait for the first election
        try:
            wait_until(lambda: store.get(cluster.keys.leader), 30, "a leader elected")
        finally:
            store.close()
        yield cluster
    finally:
        cluster.stop()
        assert not [p for p in cluster.processes if is_running(p)]


@pytest.fixture(scope="module")
def role(lc: LocalCluster) -> dict[str, TlsConfig]:
    """A certificate of each role from the cluster's own CA (what a thief of one would hold)."""
    return {r: issue(lc.tls_dir, f"probe-{r}", role=r) for r in ("client", "worker", "coordinator", "operator")}


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    """A certificate with every right name, from another CA."""
    return make_certs(tmp_path_factory.mktemp("foreign"), ["client"])["client"]


def state(lc: LocalCluster) -> dict[str, Any]:
    """What must not change: the worker's incarnation and addresses, the leader's term, the jobs, the processes."""
    store = lc.store()
    try:
        w = store.get(lc.keys.worker("w0"))
        leader = store.get(lc.keys.leader)
        jobs, _ = store.get_prefix(lc.keys.prefix + "jobs/")
    finally:
        store.close()
    assert w is not None and leader is not None
    return {"incarnation": w.create_revision, "address": w.json()["address"], "data": w.json()["data_address"],
            "term": leader.create_revision, "leader": leader.json()["address"], "jobs": [kv.key for kv in jobs],
            "running": [p.name for p in lc.processes if is_running(p)]}


def ping(lc: LocalCluster, tls: TlsConfig | None, **to: Any) -> pb.PingResponse:
    s = state(lc)
    ch = channel(s["address"], tls)
    try:
        ident = pb.Identity(cluster=lc.keys.cluster, worker_id="w0", incarnation=s["incarnation"]) if not to else \
            pb.Identity(cluster=lc.keys.cluster, worker_id="w0", **to)
        return pb_grpc.WorkerStub(ch).Ping(pb.PingRequest(to=ident), timeout=5)
    finally:
        ch.close()


def assert_unchanged(lc: LocalCluster, before: dict[str, Any]) -> None:
    assert state(lc) == before
    assert ping(lc, lc.client_tls).incarnation == before["incarnation"]  # a valid peer is still served


# -- who is refused ---------------------------------------------------------------------------------------


def test_grpc_without_a_certificate_or_with_another_cas_is_refused_by_worker_and_coordinator(
        lc: LocalCluster, foreign: TlsConfig) -> None:
    before = state(lc)
    assert ping(lc, lc.client_tls).worker_id == "w0"  # the cluster's own client certificate is served
    for tls in (None, foreign):
        with pytest.raises(grpc.RpcError) as refused:
            ping(lc, tls)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        ch = channel(before["leader"], tls)
        try:
            with pytest.raises(grpc.RpcError) as refused:
                next(pb_grpc.CoordinatorStub(ch).WatchJob(pb.WatchJobRequest(job="nope"), timeout=5))
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        finally:
            ch.close()
    ch = channel(before["leader"], lc.client_tls)  # with the right certificate the leader answers (NOT_FOUND)
    try:
        with pytest.raises(grpc.RpcError) as answered:
            next(pb_grpc.CoordinatorStub(ch).WatchJob(pb.WatchJobRequest(job="nope"), timeout=5))
        assert answered.value.code() is grpc.StatusCode.NOT_FOUND
    finally:
        ch.close()
    assert_unchanged(lc, before)


def _frame(to: pb.Identity) -> bytes:
    head = pb.TransferHeader(job="j", node="n", step=0, leaves=0, to=to).SerializeToString()
    return MAGIC + struct.pack("!I", len(head)) + head


def test_data_plane_without_a_valid_certificate_is_refused_at_the_handshake(
        lc: LocalCluster, foreign: TlsConfig) -> None:
    before = state(lc)
    host, _, port = before["data"].rpartition(":")
    frame = _frame(pb.Identity(worker_id="w0", incarnation=before["incarnation"]))
    with socket.create_connection((host, int(port)), timeout=5) as plain:  # plain TCP: no answer, closed
        plain.sendall(frame)
        try:
            answer = plain.recv(64)
        except ConnectionResetError:
            answer = b""
        assert answer[:1] in (b"", b"\x15"), answer  # closed, or a TLS alert record: never a data-plane status
    no_cert = ssl.create_default_context(cafile=str(lc.client_tls.ca))  # verifies the server, presents nothing
    for ctx in (no_cert, foreign.client_context()):
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=5), server_hostname=host) as s:
                s.sendall(frame)  # TLS 1.3: the server's refusal arrives with the first read
                if not s.recv(64):
                    raise ConnectionError("closed")
    client = DataPlaneClient(timeout_s=5, tls=foreign)
    try:
        with pytest.raises(DataPlaneError) as refused:
            client.send(before["data"], pb.TransferHeader(job="j", to=pb.Identity(worker_id="w0")), [np.ones(2)])
        assert refused.value.status is None  # the connection failed: no frame was read
    finally:
        client.close()
    assert_unchanged(lc, before)


def test_etcd_refuses_clients_without_a_certificate_and_confines_rallypoint_to_its_prefix(
        lc: LocalCluster, foreign: TlsConfig) -> None:
    before = state(lc)
    for tls in (None, foreign):
        store = EtcdStore(lc.endpoints, tls=tls, request_timeout_s=2)
        try:
            with pytest.raises(StoreError):
                store.get(lc.keys.leader)
        finally:
            store.close()
    store = lc.store()  # the rallypoint user: read-write inside the cluster's prefix, nothing outside
    try:
        assert store.get(lc.keys.leader) is not None
        store.put(lc.keys.prefix + "security-probe", "x")
        assert store.delete(lc.keys.prefix + "security-probe") == 1
        for key in ("/rallypoint/other/x", "/elsewhere", Keys("other").leader):
            with pytest.raises(StoreError, match="PERMISSION_DENIED"):
                store.put(key, "x")
            with pytest.raises(StoreError, match="PERMISSION_DENIED"):
                store.get(key)
    finally:
        store.close()
    password = lc.config.state_dir / "etcd" / "root.password"
    assert password.stat().st_mode & 0o077 == 0, "the root password is readable by others"
    assert_unchanged(lc, before)


# -- roles: each certificate may do what its role needs, nothing more ----------------------------------------


def _denied(call: Any, method: str, role: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED, refused.value.details()
    assert f"{method} is refused to role '{role}'" in (refused.value.details() or "")


def test_a_worker_or_client_certificate_is_refused_what_its_role_may_not_call(
        lc: LocalCluster, role: dict[str, TlsConfig]) -> None:
    before = state(lc)
    to = pb.Identity(cluster=lc.keys.cluster, worker_id="w0", incarnation=before["incarnation"], term=before["term"])
    stolen = channel(before["leader"], role["worker"])  # a stolen worker certificate at the leader ...
    try:
        _denied(lambda: next(pb_grpc.CoordinatorStub(stolen).SubmitJob(pb.JobSpec(job="evil"), timeout=5)),
                "/rallypoint.v1.Coordinator/SubmitJob", "worker")
        _denied(lambda: next(pb_grpc.CoordinatorStub(stolen).WatchJob(pb.WatchJobRequest(job="x"), timeout=5)),
                "/rallypoint.v1.Coordinator/WatchJob", "worker")
    finally:
        stolen.close()
    stolen = channel(before["address"], role["worker"])  # ... and at another worker
    try:
        runtime = pb_grpc.WorkerRuntimeStub(stolen)
        _denied(lambda: runtime.LoadJob(pb.LoadJobRequest(to=to, job="evil"), timeout=5),
                "/rallypoint.v1.WorkerRuntime/LoadJob", "worker")
        _denied(lambda: runtime.UnloadJob(pb.UnloadJobRequest(to=to, job="evil"), timeout=5),
                "/rallypoint.v1.WorkerRuntime/UnloadJob", "worker")
        _denied(lambda: next(runtime.FetchState(pb.FetchStateRequest(to=to, job="evil"), timeout=5)),
                "/rallypoint.v1.WorkerRuntime/FetchState", "worker")
        _denied(lambda: pb_grpc.WorkerStub(stolen).Ping(pb.PingRequest(to=to), timeout=5),
                "/rallypoint.v1.Worker/Ping", "worker")
    finally:
        stolen.close()
    client = channel(before["address"], role["client"])  # a client cannot drive a worker or raise its term
    try:
        _denied(lambda: pb_grpc.WorkerStub(client).Ping(pb.PingRequest(to=pb.Identity(term=10**9)), timeout=5),
                "/rallypoint.v1.Worker/Ping", "client")
        _denied(lambda: pb_grpc.WorkerRuntimeStub(client).RunSteps(pb.RunStepsRequest(to=to, job="x"), timeout=5),
                "/rallypoint.v1.WorkerRuntime/RunSteps", "client")
    finally:
        client.close()
    client = channel(before["leader"], role["client"])  # what a client may do, it can (the leader answers)
    try:
        with pytest.raises(grpc.RpcError) as answered:
            next(pb_grpc.CoordinatorStub(client).WatchJob(pb.WatchJobRequest(job="nope"), timeout=5))
        assert answered.value.code() is grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as answered:  # a user stops their own job ...
            pb_grpc.CoordinatorStub(client).CancelJob(pb.JobControlRequest(job="nope"), timeout=5)
        assert answered.value.code() is grpc.StatusCode.NOT_FOUND
        _denied(lambda: pb_grpc.CoordinatorStub(client).SuspendJob(pb.JobControlRequest(job="nope"), timeout=5),
                "/rallypoint.v1.Coordinator/SuspendJob", "client")  # ... setting one aside is the operator's call
    finally:
        client.close()
    operator = channel(before["leader"], role["operator"])
    try:
        with pytest.raises(grpc.RpcError) as answered:
            pb_grpc.CoordinatorStub(operator).SuspendJob(pb.JobControlRequest(job="nope"), timeout=5)
        assert answered.value.code() is grpc.StatusCode.NOT_FOUND
    finally:
        operator.close()
    assert_unchanged(lc, before)


def test_the_data_plane_takes_frames_from_workers_only(lc: LocalCluster, role: dict[str, TlsConfig]) -> None:
    before = state(lc)
    to = pb.Identity(worker_id="w0", incarnation=before["incarnation"])
    for who in ("client", "coordinator", "operator"):
        sender = DataPlaneClient(timeout_s=5, tls=role[who])
        try:
            with pytest.raises(DataPlaneError) as refused:
                sender.send(before["data"], pb.TransferHeader(job="j", to=to), [np.ones(1 << 16)])
            assert refused.value.status is Status.REFUSED
            assert f"dataplane is refused to role '{who}'" in str(refused.value)
        finally:
            sender.close()
    sender = DataPlaneClient(timeout_s=5, tls=role["worker"])  # a worker passes the role check (and finds no job)
    try:
        with pytest.raises(DataPlaneError) as no_job:
            sender.send(before["data"], pb.TransferHeader(job="j", to=to), [np.ones(2)])
        assert no_job.value.status is Status.NO_JOB
    finally:
        sender.close()
    assert_unchanged(lc, before)


def test_etcd_users_per_role_write_only_what_the_role_needs(lc: LocalCluster, role: dict[str, TlsConfig]) -> None:
    before = state(lc)
    k = lc.keys
    commit = k.checkpoint("j", "s0", 1)
    w0 = issue(lc.tls_dir, "w0-probe", role="worker", worker="w0")  # worker w0's own etcd user (the cluster added it)
    client = EtcdStore(lc.endpoints, tls=role["client"], request_timeout_s=2)
    worker = EtcdStore(lc.endpoints, tls=w0, request_timeout_s=2)
    try:
        assert client.get(k.leader) is not None and worker.get(k.leader) is not None  # both read the cluster
        for key in (k.worker("w9"), k.device("w9", 0), k.leader, commit, k.job("evil"), k.coordinator("c9")):
            with pytest.raises(StoreError, match="PERMISSION_DENIED"):
                client.put(key, "{}")  # a client registers no worker and writes no leader or commit key
        for key in (k.leader, k.coordinator("c9"), k.lost("w0"), k.prefix + "drained/w0/j", k.job_yields("j") + "s",
                    k.worker("w9"), k.lease("w0", 0), commit, k.job("evil")):
            with pytest.raises(StoreError, match="PERMISSION_DENIED"):
                worker.put(key, "{}")  # a worker cannot lead, mark peers lost, end a drain, lease or commit for a job
        with pytest.raises(StoreError, match="PERMISSION_DENIED"):
            worker.delete(k.leader)
        worker.put(k.worker_commit("w0", "j", "s0", 1), "{}")  # its own commit key: the leader promotes it or not
        worker.delete(k.worker_commit("w0", "j", "s0", 1))
    finally:
        client.close()
        worker.close()
    assert_unchanged(lc, before)


def test_a_store_without_an_identity_for_a_tls_etcd_is_a_clear_error_not_plaintext(lc: LocalCluster) -> None:
    port = lc.endpoints[0].rpartition(":")[2]
    other_name = [f"localhost:{port}"]  # the same etcd by a name no in-process cluster recorded an identity for
    with pytest.raises(ConfigError, match=f"no TLS identity for etcd at localhost:{port}.*never falls back"):
        EtcdStore(other_name)


# -- stale identities, over the wire -----------------------------------------------------------------------


def test_a_request_or_frame_for_a_stale_incarnation_or_term_is_refused(
        lc: LocalCluster, role: dict[str, TlsConfig]) -> None:
    before = state(lc)
    for to in ({"incarnation": before["incarnation"] - 1}, {"incarnation": before["incarnation"] + 1},
               {"incarnation": before["incarnation"], "term": before["term"] - 1}):
        with pytest.raises(grpc.RpcError) as refused:
            ping(lc, lc.client_tls, **to)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION, to
    client = DataPlaneClient(timeout_s=5, tls=role["worker"])  # the data plane is the workers' alone
    try:
        for to in (pb.Identity(worker_id="w0", incarnation=before["incarnation"] - 1),
                   pb.Identity(worker_id="w0", incarnation=before["incarnation"], term=before["term"] - 1)):
            with pytest.raises(DataPlaneError) as refused:
                client.send(before["data"], pb.TransferHeader(job="j", to=to), [np.ones(2)])
            assert refused.value.status is Status.REFUSED
        with pytest.raises(DataPlaneError) as no_job:  # the current identity passes the gate (and finds no job)
            client.send(before["data"], pb.TransferHeader(job="j", to=pb.Identity(
                worker_id="w0", incarnation=before["incarnation"])), [np.ones(2)])
        assert no_job.value.status is Status.NO_JOB
    finally:
        client.close()
    assert_unchanged(lc, before)


# -- malformed requests ------------------------------------------------------------------------------------


REQUEST_TYPES = {"Ping": pb.PingRequest, "LoadJob": pb.LoadJobRequest, "RunSteps": pb.RunStepsRequest,
                 "UnloadJob": pb.UnloadJobRequest, "Rewire": pb.RewireRequest, "SubmitJob": pb.JobSpec,
                 "ResumeJob": pb.ResumeRequest, "WatchJob": pb.WatchJobRequest}


def _parses(method: str, body: bytes) -> bool:
    try:
        REQUEST_TYPES[method.rsplit("/", 1)[1]].FromString(body)
        return True
    except DecodeError:
        return False


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
@given(method=st.sampled_from(WORKER_METHODS + COORDINATOR_METHODS), body=st.binary(min_size=1, max_size=512))
def test_malformed_grpc_requests_get_an_error_and_change_nothing(lc: LocalCluster, role: dict[str, TlsConfig],
                                                                 method: str, body: bytes) -> None:
    assume(not _parses(method, body))  # a well-formed request is the service's business, not the wire's
    before = state(lc)
    coordinator = method.startswith("/rallypoint.v1.Coordinator/")  # each service called by a role it serves
    ch = channel(before["leader"] if coordinator else before["address"],
                 role["client"] if coordinator else role["coordinator"])
    try:
        try:
            if coordinator:
                call = ch.unary_stream(method, request_serializer=None, response_deserializer=None)
                next(call(body, timeout=5))
            else:
                call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
                call(body, timeout=5)
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.INTERNAL, exc.details()  # the request did not deserialize
        else:
            raise AssertionError(f"{method} answered a request that does not parse")
    finally:
        ch.close()
    assert_unchanged(lc, before)


def test_no_pickle_module_is_importable_by_the_wire_path() -> None:
    """Nothing below the client pickles: no import of pickle/cloudpickle/dill, and numpy loads refuse pickles."""
    root = Path(__file__).resolve().parents[2]
    for layer in ("orchestrator", "workers", "proto", "etcd", "cluster"):
        for path in (root / layer).glob("*.py"):
            text = path.read_text()
            for bad in ("import pickle", "import cloudpickle", "import dill", "from pickle", "allow_pickle=True",
                        "pickle.loads"):
                assert bad not in text, f"{path} has {bad!r}"
