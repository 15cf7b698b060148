"""The tensor data plane over real loopback sockets: exact values, statuses, reuse, failures."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.dataplane import DataPlaneClient, DataPlaneError, DataPlaneServer, Status


@pytest.fixture
def received() -> list[tuple[pb.TransferHeader, list[np.ndarray]]]:
    return []


@pytest.fixture
def server(received: list) -> Iterator[DataPlaneServer]:  # type: ignore[type-arg]
    def handler(header: pb.TransferHeader, leaves: list[np.ndarray]) -> tuple[Status, str]:
        received.append((header, leaves))
        return {"dup": (Status.DUPLICATE, ""), "refuse": (Status.REFUSED, "fenced"), "nojob": (Status.NO_JOB, "no job"),
                "boom": (Status.INVALID, "")}.get(header.job, (Status.DELIVERED, ""))

    s = DataPlaneServer("127.0.0.1", handler)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def test_values_arrive_bit_for_bit_with_their_header(server: DataPlaneServer, received: list) -> None:  # type: ignore[type-arg]
    client = DataPlaneClient()
    leaves = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array(7, np.int32), np.zeros((0, 5), np.float64),
              np.arange(6, dtype=np.int64).reshape(2, 3).T, np.random.default_rng(0).random((300, 700))]
    try:
        dup = client.send(server.address, pb.TransferHeader(job="j", node="n", step=4, microbatch=2), leaves)
    finally:
        client.close()
    assert dup is False
    [(header, got)] = received
    assert (header.job, header.node, header.step, header.microbatch, header.leaves) == ("j", "n", 4, 2, 5)
    for a, b in zip(leaves, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.asarray(a).tobytes() == b.tobytes()


def test_statuses_reach_the_sender(server: DataPlaneServer) -> None:
    client = DataPlaneClient()
    try:
        assert client.send(server.address, pb.TransferHeader(job="dup"), [np.ones(3)]) is True
        with pytest.raises(DataPlaneError, match="fenced") as refused:
            client.send(server.address, pb.TransferHeader(job="refuse"), [np.ones(3)])
        assert refused.value.status is Status.REFUSED and refused.value.retryable
        with pytest.raises(DataPlaneError) as nojob:
            client.send(server.address, pb.TransferHeader(job="nojob"), [])
        assert nojob.value.status is Status.NO_JOB and not nojob.value.retryable
    finally:
        client.close()


def test_connections_are_reused_and_concurrent_senders_get_their_own(server: DataPlaneServer, received: list) -> None:  # type: ignore[type-arg]
    client = DataPlaneClient()
    try:
        for i in range(5):
            client.send(server.address, pb.TransferHeader(job="j", step=i), [np.full(10, i)])
        assert client._idle[server.address].qsize() == 1  # one connection carried all five

        def send(i: int) -> None:
            client.send(server.address, pb.TransferHeader(job="j", step=100 + i), [np.full(100_000, i)])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        client.close()
    steps = sorted(h.step for h, _ in received)
    assert steps == [0, 1, 2, 3, 4, 100, 101, 102, 103]
    for h, leaves in received:
        assert np.all(leaves[0] == h.step % 100)


def test_a_dead_peer_is_a_retryable_connection_failure() -> None:
    s = DataPlaneServer("127.0.0.1", lambda h, l: (Status.DELIVERED, ""))
    address = s.address
    s.stop()
    client = DataPlaneClient(timeout_s=2)
    try:
        with pytest.raises(DataPlaneError) as err:
            client.send(address, pb.TransferHeader(job="j"), [np.ones(2)])
        assert err.value.status is None and err.value.retryable
    finally:
        client.close()
