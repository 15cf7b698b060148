"""The in-memory checkpoint tier on one worker (workers/checkpoints/replicas.py): the store's bounds,
eviction and lifetime, the corrupt fault, the checksum check on fetch, and a copy pushed
and fetched over real gRPC between two worker runtime services."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest

from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.basics.logs import get_logger
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc
from rallypoint.workers.checkpoints.checksums import state_checksum
from rallypoint.workers.errors import CheckpointCorrupt
from rallypoint.workers.faults import WorkerFaults
from rallypoint.workers.runtime.checkpoints import restore
from rallypoint.workers.checkpoints.replicas import Replica, ReplicaStore, Replicator
from rallypoint.workers.runtime.service import WorkerRuntimeService
from tests.conftest import wait_until

LOG = get_logger("test")


def states(seed: int, n: int = 4) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {"s.params": [rng.normal(size=(n,)).astype(np.float32), np.arange(3, dtype=np.int32)],
            "s.opt": [rng.normal(size=(2, n)).astype(np.float32)]}


def replica(step: int, *, job: str = "j", slice_name: str = "s", n: int = 4) -> Replica:
    st = states(step, n)
    nbytes = sum(x.nbytes for v in st.values() for x in v)
    return Replica(job, slice_name, step, state_checksum(st), st, "w1", 7, nbytes)


def test_keeps_the_newest_two_copies_per_slice_in_the_order_received() -> None:
    store = ReplicaStore()
    for step in (5, 10, 15):
        assert store.put(replica(step)) == (True, "")
    store.put(replica(5, slice_name="t"))
    assert store.keys() == [("j", "s", 10), ("j", "s", 15), ("j", "t", 5)]
    store.put(replica(3))  # a replay after a fall back: the newest received counts, not the highest step
    assert [k for k in store.keys() if k[1] == "s"] == [("j", "s", 15), ("j", "s", 3)]
    assert store.get("j", "s", 10) is None and store.get("j", "s", 15) is not None


def test_byte_limit_evicts_the_oldest_copies_of_any_job_and_refuses_what_cannot_fit() -> None:
    one = replica(1).nbytes
    store = ReplicaStore(limit_bytes=2 * one + 1, per_slice=5)
    store.put(replica(1, job="a"))
    store.put(replica(2, job="b"))
    store.put(replica(3, job="a"))
    assert store.keys() == [("b", "s", 2), ("a", "s", 3)] and store.nbytes <= 2 * one + 1
    stored, why = store.put(replica(4, n=1000))
    assert not stored and "exceed the replica store's limit" in why
    assert store.keys() == [("b", "s", 2), ("a", "s", 3)]


def test_a_job_idle_past_the_ttl_is_dropped_and_drop_job_forgets_a_job() -> None:
    now = [0.0]
    store = ReplicaStore(ttl_s=10, clock=lambda: now[0])
    store.put(replica(1, job="a"))
    now[0] = 8.0
    store.put(replica(1, job="b"))
    now[0] = 12.0
    assert store.get("a", "s", 1) is None and store.get("b", "s", 1) is not None
    assert store.drop_job("b") == 1 and store.keys() == []


def test_the_corrupt_fault_flips_a_byte_so_the_checksum_no_longer_matches() -> None:
    r = replica(1)
    original = {k: [x.copy() for x in v] for k, v in r.states.items()}
    ReplicaStore(corrupt=True).put(r)
    assert state_checksum(r.states) != r.checksum
    assert state_checksum(original) == r.checksum, "the sender's arrays must not be touched"


def test_bad_store_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="per_slice=0"):
        ReplicaStore(per_slice=0)


# -- over real gRPC ----------------------------------------------------------------------


def serve(worker_id: str, faults: WorkerFaults = WorkerFaults()) -> tuple[WorkerRuntimeService, grpc.Server, str]:
    svc = WorkerRuntimeService(worker_id, admit=lambda to: None, devices=[], incarnation=lambda: 7, faults=faults)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_WorkerRuntimeServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return svc, server, f"127.0.0.1:{port}"


@pytest.fixture
def holders() -> Any:
    started: list[tuple[WorkerRuntimeService, grpc.Server]] = []

    def start(worker_id: str, faults: WorkerFaults = WorkerFaults()) -> tuple[WorkerRuntimeService, str]:
        svc, server, address = serve(worker_id, faults)
        started.append((svc, server))
        return svc, address

    yield start
    for svc, server in started:
        server.stop(0)
        svc.close()


def push_and_restore(holder: WorkerRuntimeService, address: str, restorer: WorkerRuntimeService,
                     tmp_path: Any) -> tuple[dict[str, Any], dict[str, str]]:
    st = states(42, n=300_000)  # > 1 MiB: several chunks
    c = CheckpointCommit("j", "s", 10, str(tmp_path / "none" / "10"), state_checksum(st), tuple(sorted(st)))
    target = pb.ReplicaPeer(slice="s", worker_id=holder.worker_id, address=address, incarnation=7)
    rep = Replicator(restorer.peers, [target], cluster="c", worker_id="w1", incarnation=3, log=LOG)
    try:
        rep.submit(c, st)
        wait_until(lambda: rep.pushed, 10, "the copy to be pushed")
        assert rep.pushed == [("s", 10, holder.worker_id)]
    finally:
        rep.close()
    req = pb.LoadJobRequest(to=pb.Identity(cluster="c", worker_id=restorer.worker_id), job="j", start_step=10,
                            restore=[pb.CheckpointRef(slice="s", step=10, path=c.path, checksum=c.checksum)],
                            replica_sources=[target])
    tiers: dict[str, str] = {}
    got = restore(req, lambda ref: restorer.replicas.fetch(req, ref, LOG), tiers)
    assert state_checksum(got["s"]) == c.checksum
    return got, tiers


def test_a_copy_pushed_to_a_peer_restores_from_memory_with_its_checksum(holders: Any, tmp_path: Any) -> None:
    holder, address = holders("w2")
    restorer, _ = holders("w3")
    _, tiers = push_and_restore(holder, address, restorer, tmp_path)
    assert tiers == {"s": "memory"}
    assert holder.replicas.store.keys() == [("j", "s", 10)]


def test_a_corrupt_copy_is_rejected_and_the_restore_reads_the_disk(holders: Any, tmp_path: Any) -> None:
    holder, address = holders("w2", WorkerFaults(corrupt_replicas=True))
    restorer, _ = holders("w3")
    # No checkpoint on disk at the commit's path: falling back must fail loudly, naming the commit.
    with pytest.raises(CheckpointCorrupt, match="slice 's' at step 10"):
        push_and_restore(holder, address, restorer, tmp_path)


def test_a_missing_copy_or_unreachable_holder_gives_none(holders: Any) -> None:
    _, address = holders("w2")
    restorer, _ = holders("w3")
    ref = pb.CheckpointRef(slice="s", step=10, path="/nowhere", checksum="sha256:00")
    for peer in (pb.ReplicaPeer(slice="s", worker_id="w2", address=address),
                 pb.ReplicaPeer(slice="s", worker_id="w9", address="127.0.0.1:1")):
        req = pb.LoadJobRequest(job="j", replica_sources=[peer])
        assert restorer.replicas.fetch(req, ref, LOG) is None
