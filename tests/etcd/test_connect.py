"""A short-lived client's first etcd call survives a connection cut short (a real etcd behind a real proxy that
resets the first connections, as a loaded host's etcd drops a TLS handshake)."""

from __future__ import annotations

import json
import socket

import pytest
from click.testing import CliRunner

from rallypoint.basics.errors import StoreUnavailable
from rallypoint.chaos.proxy import TcpProxy
from rallypoint.cli import main
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.server import EtcdCluster
from tests.helpers.checkpoints import register


class ResetsFirst(TcpProxy):
    """A proxy that resets its first ``n`` connections as soon as they are accepted."""

    def __init__(self, target: str, n: int) -> None:
        self.left = n
        super().__init__(target)

    def _open(self, conn: socket.socket) -> None:
        with self._lock:
            reset, self.left = self.left > 0, self.left - 1
        if reset:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()
            return
        super()._open(conn)


def test_a_store_without_a_connect_wait_fails_its_first_call_on_a_reset_connection(etcd: EtcdCluster) -> None:
    proxy = ResetsFirst(etcd.endpoints[0], 1)
    store = EtcdStore([proxy.address], tls=None)
    try:
        with pytest.raises(StoreUnavailable, match="etcd unreachable"):
            store.get("k")
    finally:
        store.close()
        proxy.close()


def test_a_cli_command_redials_connections_cut_short_before_its_first_call(etcd: EtcdCluster) -> None:
    seed = EtcdStore(etcd.endpoints, tls=None)
    try:
        register(seed, Keys("t"), "w1")
    finally:
        seed.close()
    proxy = ResetsFirst(etcd.endpoints[0], 2)
    try:
        r = CliRunner().invoke(main, ["workers", "--cluster", f"t@{proxy.address}", "--insecure", "--json"])
        assert r.exit_code == 0, r.output
        assert [json.loads(line)["worker"] for line in r.output.splitlines()] == ["w1"]
        assert proxy.left < 0  # both resets happened, and a third connection carried the calls
    finally:
        proxy.close()
