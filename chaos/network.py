"""Real network partitions of single workers of the embedded local cluster: the common interface.

Two ways to cut one worker off while its process keeps running, each in its own module:

* network namespaces (root; :mod:`rallypoint.chaos.netns`, :class:`NetnsNetwork`): every
  worker runs in its own Linux network namespace behind a veth pair on a bridge that
  carries the host address etcd and the coordinators listen on. Partitioning a worker
  takes the root-side end of its veth down, exactly as a pulled cable.

* loopback TCP proxies (anyone; the fallback; :mod:`rallypoint.chaos.proxy`,
  :class:`TcpProxy`): in ``proxy`` mode each worker reaches etcd through its own proxies
  and is reached through proxies in front of its gRPC server and data plane (it
  advertises their addresses); a partition freezes all of them. Unlike netns, the
  worker's own outgoing connections to *other workers* are not cut.

This module holds what the chaos harness and tests use either way: :class:`PartitionControl`
(``partition``/``heal``/``close``, and the cluster's ``worker_network`` hook), its two
kinds :class:`NetnsPartitions` and :class:`ProxyPartitions`, and
:func:`start_partitionable_cluster`, which starts a :class:`~rallypoint.cluster.local.LocalCluster`
either way and returns its control. ``NetnsNetwork``, ``NetworkError`` and ``TcpProxy``
stay importable from here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from rallypoint.basics.errors import ConfigError
from rallypoint.basics.logs import get_logger
from rallypoint.chaos.netns import NetnsNetwork, NetworkError
from rallypoint.chaos.proxy import TcpProxy
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig, WorkerNetwork
from rallypoint.etcd.server import free_port

__all__ = [
    "NetnsNetwork", "NetnsPartitions", "NetworkError", "PartitionControl", "ProxyPartitions", "TcpProxy",
    "partitionable_cluster", "start_partitionable_cluster",
]


class PartitionControl:
    """Partitions single workers of one cluster; made by :func:`start_partitionable_cluster`.

    ``mode`` is ``netns`` or ``proxy``; :meth:`worker_network` is the cluster's
    ``worker_network`` hook. Call :meth:`close` after ``LocalCluster.stop()``.
    """

    mode = ""

    def __init__(self) -> None:
        self.partitioned: set[str] = set()
        self.log = get_logger("rallypoint.chaos.network", mode=self.mode)

    def worker_network(self, name: str, endpoints: Sequence[str]) -> WorkerNetwork:
        raise NotImplementedError

    def partition(self, worker: str) -> None:
        """Cut ``worker`` off from etcd, the coordinators and (netns) the other workers."""
        self._cut(worker, True)
        self.partitioned.add(worker)
        self.log.info("chaos.partitioned", worker=worker)

    def heal(self, worker: str) -> None:
        """Undo :meth:`partition`."""
        self._cut(worker, False)
        self.partitioned.discard(worker)
        self.log.info("chaos.healed", worker=worker)

    def _cut(self, worker: str, cut: bool) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class NetnsPartitions(PartitionControl):
    """Partitions through a :class:`NetnsNetwork` (already set up)."""

    mode = "netns"

    def __init__(self, net: NetnsNetwork) -> None:
        super().__init__()
        self.net = net

    def worker_network(self, name: str, endpoints: Sequence[str]) -> WorkerNetwork:
        ns, addr = self.net.add_worker(name)
        return WorkerNetwork(prefix=("ip", "netns", "exec", ns), host=addr)

    def _cut(self, worker: str, cut: bool) -> None:
        (self.net.partition if cut else self.net.heal)(worker)

    def close(self) -> None:
        self.net.teardown()


@dataclass
class _Proxied:
    etcd: list[TcpProxy]
    grpc: TcpProxy
    data: TcpProxy

    def all(self) -> list[TcpProxy]:
        return [*self.etcd, self.grpc, self.data]


class ProxyPartitions(PartitionControl):
    """Partitions through :class:`TcpProxy`: a worker's etcd, gRPC and data-plane paths are cut."""

    mode = "proxy"

    def __init__(self) -> None:
        super().__init__()
        self.proxies: dict[str, _Proxied] = {}

    def worker_network(self, name: str, endpoints: Sequence[str]) -> WorkerNetwork:
        port, data_port = free_port(), free_port()
        while data_port == port:
            data_port = free_port()
        px = self.proxies.get(name)
        if px is None:  # a restarted worker keeps its proxies (and advertised addresses)
            px = _Proxied([TcpProxy(ep) for ep in endpoints], TcpProxy(("127.0.0.1", port)),
                          TcpProxy(("127.0.0.1", data_port)))
            self.proxies[name] = px
        px.grpc.target, px.data.target = ("127.0.0.1", port), ("127.0.0.1", data_port)
        return WorkerNetwork(endpoints=tuple(p.address for p in px.etcd), port=port, data_port=data_port,
                             advertise_address=px.grpc.address, advertise_data_address=px.data.address)

    def _cut(self, worker: str, cut: bool) -> None:
        if worker not in self.proxies:
            raise ConfigError(f"worker {worker!r} has no proxies here; known: {sorted(self.proxies)}")
        for p in self.proxies[worker].all():
            if cut:
                p.cut(freeze=True)  # stall, not reset: a reset would look like a crash to the coordinator
            else:
                p.restore()

    def close(self) -> None:
        for px in self.proxies.values():
            for p in px.all():
                p.close()
        self.proxies.clear()


def start_partitionable_cluster(config: LocalClusterConfig, *, mode: str | None = None,
                                wait_s: float = 90.0) -> tuple[LocalCluster, PartitionControl]:
    """Start a local cluster whose workers can be partitioned one by one.

    Args:
        config: the cluster; its ``network`` and (netns) ``host`` are set here.
        mode: ``netns``, ``proxy``, or None: ``config.network`` unless it is
            ``loopback``, then netns where :meth:`NetnsNetwork.available`, else proxy.

    Returns:
        ``(cluster, control)``: stop the cluster first, then ``control.close()``.

    Raises:
        ConfigError: netns asked for but unavailable (not root, or ``ip netns`` fails).
    """
    netns_ok = NetnsNetwork.available() if mode in (None, "netns") else False
    if mode is None:
        mode = config.network if config.network != "loopback" else ("netns" if netns_ok else "proxy")
    control: PartitionControl
    if mode == "netns":
        if not netns_ok:
            raise ConfigError("network='netns' needs root and a working `ip netns add`; use mode='proxy'")
        net = NetnsNetwork()
        try:
            config = replace(config, network="netns", host=net.setup())
        except BaseException:
            net.teardown()
            raise
        control = NetnsPartitions(net)
    elif mode == "proxy":
        config = replace(config, network="proxy")
        control = ProxyPartitions()
    else:
        raise ConfigError(f"partition mode must be netns or proxy, got {mode!r}")
    try:
        lc = LocalCluster.start(config, wait_s=wait_s, worker_network=control.worker_network)
    except BaseException:
        control.close()
        raise
    return lc, control


@contextlib.contextmanager
def partitionable_cluster(config: LocalClusterConfig, *, mode: str | None = None,
                          wait_s: float = 90.0) -> Iterator[tuple[LocalCluster, PartitionControl]]:
    """:func:`start_partitionable_cluster` as a context: stops the cluster, then tears the network down."""
    lc, control = start_partitionable_cluster(config, mode=mode, wait_s=wait_s)
    try:
        yield lc, control
    finally:
        try:
            lc.stop()
        finally:
            control.close()
