"""A real mutual-TLS data-plane server flooded with idle, unauthenticated connections, and one whose threads
cannot start: it bounds what the flood holds, its accept loop survives, and a real peer (a certificate of the
cluster's CA) is served afterwards.

Before, every accepted connection got a thread of its own, held up to the 10 s handshake timeout, with no cap;
an exception from ``Thread.start()`` under a flood ended the accept loop, and the worker never accepted a
data-plane connection again.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from rallypoint.basics.tls import TlsConfig
from rallypoint.cluster.certs import make_certs
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers import dataplane
from rallypoint.workers.dataplane import DataPlaneClient, DataPlaneServer, Status
from tests.conftest import wait_until


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsConfig]:
    return make_certs(tmp_path_factory.mktemp("tls"), ["server:worker", "peer:worker"])


@pytest.fixture
def server(certs: dict[str, TlsConfig], monkeypatch: pytest.MonkeyPatch) -> Iterator[DataPlaneServer]:
    monkeypatch.setattr(dataplane, "HANDSHAKE_DEADLINE_S", 2.0, raising=False)  # the flood times out sooner here
    got: list[pb.TransferHeader] = []

    def handler(header: pb.TransferHeader, leaves: list[np.ndarray]) -> tuple[Status, str]:
        got.append(header)
        return Status.DELIVERED, ""

    s = DataPlaneServer("127.0.0.1", handler, tls=certs["server"])
    s.got = got  # type: ignore[attr-defined]
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _send(certs: dict[str, TlsConfig], server: DataPlaneServer, job: str) -> None:
    client = DataPlaneClient(tls=certs["peer"], timeout_s=10)
    try:
        client.send(server.address, pb.TransferHeader(job=job), [np.arange(8, dtype=np.float32)])
    finally:
        client.close()


def _conn_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "dataplane-conn")


def test_a_flood_of_idle_connections_holds_at_most_the_cap_and_a_peer_is_served_after(
        certs: dict[str, TlsConfig], server: DataPlaneServer) -> None:
    host, port = server.address.rsplit(":", 1)
    flood, most = [], 0
    try:
        for _ in range(3 * dataplane.MAX_UNAUTHENTICATED):
            flood.append(socket.create_connection((host, int(port))))
            most = max(most, _conn_threads())
        wait_until(lambda: server.refused_connections > 0, 5, "the connections over the cap closed at once")
        most = max(most, _conn_threads())
        assert most <= dataplane.MAX_UNAUTHENTICATED  # main: one thread per connection, up to 192 here
        wait_until(lambda: _conn_threads() == 0, 10, "the idle handshakes timed out")
        _send(certs, server, "after-flood")  # the flood's sockets are still open on the attacker's side
    finally:
        for s in flood:
            s.close()
    assert [h.job for h in server.got] == ["after-flood"]  # type: ignore[attr-defined]
    assert server._thread.is_alive()


def test_the_accept_loop_survives_threads_that_cannot_start(certs: dict[str, TlsConfig], server: DataPlaneServer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    real_start = threading.Thread.start
    failures = {"left": 5}

    def start(self: threading.Thread, *a: Any, **kw: Any) -> None:
        if self.name == "dataplane-conn" and failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("can't start new thread")  # what CPython raises when the process is out of threads
        real_start(self, *a, **kw)

    monkeypatch.setattr(threading.Thread, "start", start)
    host, port = server.address.rsplit(":", 1)
    for _ in range(5):
        socket.create_connection((host, int(port))).close()
    _send(certs, server, "after-failures")  # main: the loop ended at the first failure; this one hung, unaccepted
    assert server.accept_errors == 5 and server._thread.is_alive()
    assert [h.job for h in server.got] == ["after-failures"]  # type: ignore[attr-defined]
