"""Malformed data-plane frames (hypothesis) against a real mutual-TLS data-plane socket.

Each malformed frame gets an ``INVALID`` answer or a closed connection, never reaches the handler, and
leaves the server serving a valid peer. TLS itself (the handshake refusing a peer without a certificate
of the CA) is checked here on a bare server and on a real worker in tests/integration/test_security.py.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rallypoint.cluster.certs import make_certs
from rallypoint.basics.tls import TlsConfig
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.dataplane import MAGIC, DataPlaneClient, DataPlaneError, DataPlaneServer, Status

U32 = struct.Struct("!I")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsConfig]:
    return make_certs(tmp_path_factory.mktemp("tls"), ["server:worker", "client:worker"])  # the data plane: workers


@pytest.fixture(scope="module")
def received() -> list[pb.TransferHeader]:
    return []


@pytest.fixture(scope="module")
def server(certs: dict[str, TlsConfig], received: list[pb.TransferHeader]) -> Iterator[DataPlaneServer]:
    def handler(header: pb.TransferHeader, leaves: list[np.ndarray]) -> tuple[Status, str]:
        received.append(header)
        return Status.DELIVERED, ""

    s = DataPlaneServer("127.0.0.1", handler, tls=certs["server"])
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _tensor(dtype: str, shape: list[int]) -> bytes:
    meta = pb.Tensor(dtype=dtype, shape=shape).SerializeToString()
    return U32.pack(len(meta)) + meta


def _frame(header: bytes, *leaves: bytes) -> bytes:
    return MAGIC + U32.pack(len(header)) + header + b"".join(leaves)


def _head(leaves: int) -> bytes:
    return pb.TransferHeader(job="j", node="n", leaves=leaves).SerializeToString()


# Frames that are malformed by construction: wrong magic, a header that does not parse or is over the
# limit, a leaf whose dtype is unknown or not plain data (object, structured), a negative or huge shape,
# metadata over the limit or carrying data, too many leaves.
_bad_magic = st.binary(min_size=4, max_size=64).filter(lambda b: not b.startswith(MAGIC))
_bad_header = st.sampled_from([b"\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x08", b"\x12\x05ab"]).map(_frame)
_huge_header = st.integers(min_value=(1 << 20) + 1, max_value=(1 << 32) - 1).map(
    lambda n: MAGIC + U32.pack(n) + b"x" * 16)
_bad_dtype = st.sampled_from(["object", "O", "nope", "", "V0,i4", "(2,)i4", "U8", "S3", "M8[s]", "[('a','i4')]"]).map(
    lambda d: _frame(_head(1), _tensor(d, [2])))
_bad_shape = st.lists(st.integers(min_value=-(1 << 62), max_value=(1 << 62)), min_size=1, max_size=40).filter(
    lambda s: any(d < 0 for d in s) or len(s) > 32 or np.prod([float(d) for d in s]) * 8 > (1 << 36)).map(
    lambda s: _frame(_head(1), _tensor("float64", s)))
_big_meta = st.just(_frame(_head(1), U32.pack(1 << 20) + b"\x00" * 64))
_meta = pb.Tensor(dtype="u1", shape=[1], data=b"x").SerializeToString()
_meta_with_data = st.just(_frame(_head(1), U32.pack(len(_meta)) + _meta))
_many_leaves = st.integers(min_value=(1 << 16) + 1, max_value=(1 << 31) - 1).map(lambda n: _frame(_head(n)))
MALFORMED = st.one_of(_bad_magic, _bad_header, _huge_header, _bad_dtype, _bad_shape, _big_meta, _meta_with_data,
                      _many_leaves)


def _exchange(server: DataPlaneServer, tls: TlsConfig, data: bytes) -> bytes:
    """Send ``data`` on a fresh mutual-TLS connection; everything the server answers before it closes
    (a server that neither answers nor closes within 5 s fails the test)."""
    host, _, port = server.address.rpartition(":")
    ctx = tls.client_context()
    with ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=5), server_hostname=host) as s:
        try:
            s.sendall(data)
        except OSError:
            pass  # the server may close before it read everything
        out = b""
        while True:
            try:
                chunk = s.recv(4096)
            except TimeoutError:
                raise AssertionError(f"the server neither answered nor closed; it sent {out!r}") from None
            except (ssl.SSLError, ConnectionError, OSError):
                break
            if not chunk:
                break
            out += chunk
    return out


def _valid_send(server: DataPlaneServer, tls: TlsConfig, step: int) -> None:
    client = DataPlaneClient(timeout_s=10, tls=tls)
    try:
        assert client.send(server.address, pb.TransferHeader(job="ok", step=step), [np.arange(5.0)]) is False
    finally:
        client.close()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=MALFORMED)
def test_a_malformed_frame_gets_an_error_closes_the_connection_and_changes_nothing(
        server: DataPlaneServer, certs: dict[str, TlsConfig], received: list[pb.TransferHeader], frame: bytes) -> None:
    before = len(received)
    answer = _exchange(server, certs["client"], frame)  # returns only once the server closed the connection
    assert answer[:1] == bytes([Status.INVALID]), answer[:64]  # INVALID, u32 length, what was wrong
    (n,) = U32.unpack(answer[1:5])
    assert len(answer) == 5 + n and n > 0
    assert len(received) == before, "a malformed frame reached the handler"
    _valid_send(server, certs["client"], before)  # the server still serves a valid peer
    assert received[-1].job == "ok" and len(received) == before + 1


def test_truncated_frames_never_reach_the_handler(server: DataPlaneServer, certs: dict[str, TlsConfig],
                                                  received: list[pb.TransferHeader]) -> None:
    whole = _frame(_head(1), _tensor("float32", [4]), np.arange(4, dtype=np.float32).tobytes())
    host, _, port = server.address.rpartition(":")
    before = len(received)
    for cut in range(1, len(whole), 3):  # the peer goes away mid-frame
        with certs["client"].client_context().wrap_socket(socket.create_connection((host, int(port)), timeout=10),
                                                          server_hostname=host) as s:
            s.sendall(whole[:cut])
    _valid_send(server, certs["client"], 0)
    assert [h.job for h in received[before:]] == ["ok"], "a truncated frame reached the handler"


def test_a_peer_without_a_certificate_of_the_ca_is_refused(server: DataPlaneServer, certs: dict[str, TlsConfig],
                                                          tmp_path: Path, received: list[pb.TransferHeader]) -> None:
    before = len(received)
    other = make_certs(tmp_path / "other", ["client"])["client"]
    for tls in (other,):
        client = DataPlaneClient(timeout_s=5, tls=tls)
        try:
            with pytest.raises(DataPlaneError) as refused:
                client.send(server.address, pb.TransferHeader(job="x"), [np.ones(1)])
            assert refused.value.status is None
        finally:
            client.close()
    plain = DataPlaneClient(timeout_s=5)
    try:
        with pytest.raises(DataPlaneError):
            plain.send(server.address, pb.TransferHeader(job="x"), [np.ones(1)])
    finally:
        plain.close()
    assert len(received) == before
    _valid_send(server, certs["client"], 1)
