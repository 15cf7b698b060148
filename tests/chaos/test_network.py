"""Real partitions of one worker of a local cluster: network namespaces (root) and TCP proxies."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rallypoint.chaos.network import NetnsNetwork, PartitionControl, TcpProxy, start_partitionable_cluster
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.basics.errors import ConfigError
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig, is_running
from tests.conftest import read_events, wait_until

TTL_S = 1
DETECT_MARGIN_S = 2.5  # etcd's expiry check, the watch, a loaded machine


def _config(tmp_path: Path) -> LocalClusterConfig:
    return LocalClusterConfig(state_dir=tmp_path / "cluster", workers=2, spares=0, devices_per_worker=1,
                              coordinators=1, lease_ttl_s=TTL_S)


def _stop(lc: LocalCluster, control: PartitionControl) -> None:
    try:
        lc.stop()
        left = [p for p in lc.processes if is_running(p)]
        assert not left, f"processes left running: {left}"
    finally:
        control.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _connects_from(netns: str, address: str) -> bool:
    """Whether a TCP connection from inside ``netns`` to ``address`` completes within 1 s."""
    host, _, port = address.rpartition(":")
    code = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1).close()"
    return subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", code],
                          capture_output=True, timeout=30).returncode == 0


def _partition_and_heal(lc: LocalCluster, control: PartitionControl) -> dict[str, float]:
    """Partition w0, check it is lost while alive, heal it, check a new incarnation; the timings."""
    store = lc.store()
    try:
        coordinator_log = lc.process("c0").log
        wait_until(lambda: len(read_events(coordinator_log, "worker.joined")) >= 2, 10, "the leader attaches")
        old = store.get(lc.keys.worker("w0"))
        other = store.get(lc.keys.worker("w1"))
        assert old is not None and other is not None
        pid = lc.process("w0").pid

        t0 = time.monotonic()
        control.partition("w0")
        wait_until(lambda: store.get(lc.keys.worker("w0")) is None, TTL_S + DETECT_MARGIN_S, "w0's key to go")
        detected_s = time.monotonic() - t0
        lost = wait_until(lambda: store.get(lc.keys.lost("w0")), 2, "w0 recorded lost").json()
        # Nothing broke a connection: the loss came from the silence of its heartbeats (the leader
        # fences it) or from its lease, whichever ran out first, as for a real partition.
        assert lost["reason"] in ("silent", "lease_expired") and lost["incarnation"] == old.create_revision
        assert _alive(pid) and is_running(lc.process("w0")), "the partitioned worker must keep running"
        wait_until(lambda: read_events(lc.process("w0").log, "worker.fenced"), 5, "w0 to fence itself")
        gone, before_heal = store.get_prefix(lc.keys.worker("w0"))
        assert not gone, "a partitioned worker re-registered"

        t1 = time.monotonic()
        control.heal("w0")
        new = wait_until(lambda: store.get(lc.keys.worker("w0")), 10, "w0 to re-register")
        reregistered_s = time.monotonic() - t1
        # Not re-registered at any time during the partition: only after the heal.
        assert new.create_revision > before_heal, "a partitioned worker re-registered"
        assert new.json()["pid"] == pid, "the same process registers again"
        ended = read_events(lc.process("w0").log, "worker.incarnation_ended")
        assert [e["incarnation"] for e in ended] == [old.create_revision]
        wait_until(lambda: any(e["worker"] == "w0" and e["incarnation"] == new.create_revision
                               for e in read_events(coordinator_log, "worker.joined")),
                   10, "the leader to attach to w0's new incarnation")
        rejoined_s = time.monotonic() - t1
        still = store.get(lc.keys.worker("w1"))
        assert still is not None and still.create_revision == other.create_revision, "w1 was disturbed"
        return {"detected_s": detected_s, "reregistered_s": reregistered_s, "rejoined_s": rejoined_s}
    finally:
        store.close()


@pytest.mark.processes
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")
def test_netns_partition_loses_a_live_worker_and_heal_brings_a_new_incarnation(tmp_path: Path) -> None:
    lc, control = start_partitionable_cluster(_config(tmp_path), mode="netns")
    net: NetnsNetwork = control.net  # type: ignore[attr-defined]
    token = net.token
    try:
        assert control.mode == "netns" and lc.config.network == "netns"
        assert lc.config.host == net.host_ip and all(e.startswith(net.host_ip + ":") for e in lc.endpoints)
        store = lc.store()
        try:
            snap = read_cluster(store, lc.keys)
        finally:
            store.close()
        assert sorted(snap.workers) == ["w0", "w1"]
        for w, s in snap.workers.items():
            ns_ip = net.workers[w].ip
            assert s.info.address.startswith(ns_ip + ":") and s.info.data_address.startswith(ns_ip + ":")
        # Workers reach each other across the bridge; the partition cuts that too.
        w0_addr, ns1 = snap.workers["w0"].info.address, net.workers["w1"].netns
        assert _connects_from(ns1, w0_addr)

        timings = _partition_and_heal(lc, control)
        print(f"netns: {timings}")
        assert _connects_from(ns1, w0_addr)

        # cluster.json knows the network and every pid: load + stop (`rallypoint down`) stops all.
        loaded = LocalCluster.load(lc.config.state_dir)
        assert (loaded.config.network, loaded.config.host) == ("netns", net.host_ip)
        assert loaded.worker_networks["w0"].prefix == ("ip", "netns", "exec", net.workers["w0"].netns)
        loaded.stop()
        assert not [p for p in loaded.processes if is_running(p)]
    finally:
        _stop(lc, control)
    assert token not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert token not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    control.close()  # idempotent


@pytest.mark.processes
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")
def test_netns_partition_cuts_both_directions_and_teardown_is_exact() -> None:
    with NetnsNetwork() as a, NetnsNetwork() as b:
        assert a.subnet != b.subnet and a.token != b.token
        ns, addr = a.add_worker("w0")
        assert a.add_worker("w0") == (ns, addr)
        server = socket.create_server((a.host_ip, 0))
        try:
            target = f"{a.host_ip}:{server.getsockname()[1]}"
            assert _connects_from(ns, target)
            a.partition("w0")
            assert not _connects_from(ns, target)
            a.heal("w0")
            assert _connects_from(ns, target)
        finally:
            server.close()
    for net in (a, b):
        assert net.token not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    a.teardown()  # idempotent


@pytest.mark.processes
def test_proxy_partition_loses_a_live_worker_and_heal_brings_a_new_incarnation(tmp_path: Path) -> None:
    lc, control = start_partitionable_cluster(_config(tmp_path), mode="proxy")
    try:
        assert control.mode == "proxy" and lc.config.network == "proxy"
        timings = _partition_and_heal(lc, control)
        print(f"proxy: {timings}")
    finally:
        _stop(lc, control)


@pytest.fixture
def echo_server() -> Iterator[tuple[socket.socket, list[socket.socket]]]:
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn: socket.socket) -> None:
        try:
            while data := conn.recv(4096):
                conn.sendall(data)
        except OSError:
            pass
        finally:
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server, accepted
    finally:
        server.close()


def _recv_exact(s: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def _roundtrip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(payload)
        return _recv_exact(s, len(payload))


def test_tcp_proxy_forwards_cuts_and_restores(echo_server: tuple[socket.socket, list[socket.socket]]) -> None:
    server, accepted = echo_server
    proxy = TcpProxy(server.getsockname()[:2])
    try:
        big = os.urandom(1 << 20)
        assert _roundtrip(proxy.port, b"hello") == b"hello"
        assert _roundtrip(proxy.port, big) == big
        open_conn = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
        open_conn.sendall(b"ping")
        assert open_conn.recv(4) == b"ping"
        seen = len(accepted)

        proxy.cut()
        with pytest.raises(OSError):  # reset; a read of b"" (closed) would also be a break
            if open_conn.recv(4) == b"":
                raise ConnectionResetError("closed")
        open_conn.close()
        late = socket.create_connection(("127.0.0.1", proxy.port), timeout=0.5)
        late.sendall(b"lost")
        with pytest.raises(TimeoutError):
            late.recv(4)  # black-holed: nothing forwarded, nothing back
        assert len(accepted) == seen, "a connection reached the target while cut"
        assert proxy.dropped == 1

        proxy.restore()
        with pytest.raises(OSError):  # connections held during the cut are reset
            if late.recv(4) == b"":
                raise ConnectionResetError("closed")
        late.close()
        assert _roundtrip(proxy.port, b"again") == b"again"
        assert (proxy.cuts, proxy.forwarded) == (1, 4)

        # freeze (what a proxy-mode partition does): open connections stall, then flow on.
        stalled = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
        stalled.sendall(b"a")
        assert stalled.recv(1) == b"a"
        proxy.cut(freeze=True)
        stalled.sendall(b"frozen")
        stalled.settimeout(0.5)
        with pytest.raises(TimeoutError):
            stalled.recv(6)
        waiting = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
        waiting.sendall(b"late")
        wait_until(lambda: proxy.dropped == 2, 5, "the frozen proxy to take the new connection")  # and hold it
        assert len(accepted) == seen + 2, "a connection reached the target while frozen"
        proxy.restore()
        stalled.settimeout(2)
        assert _recv_exact(stalled, 6) == b"frozen" and _recv_exact(waiting, 4) == b"late"
        stalled.close()
        waiting.close()
        assert (proxy.cuts, proxy.forwarded, proxy.dropped) == (2, 6, 2)
    finally:
        proxy.close()
        proxy.close()
    with pytest.raises(OSError):
        _roundtrip(proxy.port, b"x")


def test_network_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="network must be one of"):
        LocalClusterConfig(state_dir=tmp_path, network="wifi")
    with pytest.raises(ConfigError, match="host must be an IPv4"):
        LocalClusterConfig(state_dir=tmp_path, host="localhost")
    with pytest.raises(ConfigError, match="namespaces can reach"):
        LocalClusterConfig(state_dir=tmp_path, network="netns")
    with pytest.raises(ConfigError, match="worker_network hook"):
        LocalCluster.start(LocalClusterConfig(state_dir=tmp_path, network="proxy"))
    with pytest.raises(ConfigError, match="netns or proxy"):
        start_partitionable_cluster(LocalClusterConfig(state_dir=tmp_path), mode="bogus")
    assert not (tmp_path / "cluster.json").exists()


def test_teardown_takes_a_link_that_vanished_during_its_delete_as_deleted(monkeypatch: pytest.MonkeyPatch) -> None:
    # Deleting a namespace removes the veth peers in it asynchronously, so the delete of
    # such a link may find it gone midway: `ip` then says "RTNETLINK answers: No such
    # device" (seen in CI), not "Cannot find device". Both mean the link is gone.
    from rallypoint.chaos import netns

    said = {"rpvgone0": "RTNETLINK answers: No such device", "rpvgone1": 'Cannot find device "rpvgone1"',
            "rpbrbusy": "RTNETLINK answers: Device or resource busy"}

    def ip(*args: str) -> str:
        raise netns.NetworkError(["ip", *args], said[args[-1]])

    monkeypatch.setattr(netns, "ip", ip)
    links = ["rpbrbusy", "rpvgone0", "rpvgone1"]
    errors = netns._teardown([], links)
    assert links == ["rpbrbusy"], "a link that is gone must leave the list; one that is busy must stay"
    assert len(errors) == 1 and "busy" in errors[0]
