"""Real network partitions of single workers of the embedded local cluster.

Two ways to cut one worker off while its process keeps running:

* :class:`NetnsNetwork` (root): every worker runs in its own Linux network
  namespace, joined by a veth pair to a bridge in the root namespace that carries
  the host address etcd and the coordinators listen on. Partitioning a worker takes
  the root-side end of its veth down: nothing passes in either direction, open
  connections hang, new ones time out, exactly as a pulled cable.

  (A bridge rather than a dummy link plus per-worker routes: worker-to-worker traffic
  then stays on one L2 segment and needs no ``net.ipv4.ip_forward``, a global sysctl
  this module should not flip, and which is 0 here.)

* :class:`TcpProxy` (anyone; the fallback): a loopback TCP proxy whose ``cut()``
  resets every open connection and black-holes new ones (``cut(freeze=True)``
  stalls open ones instead). In ``proxy`` mode each worker reaches etcd through its
  own proxies and is reached through proxies in front of its gRPC server and data
  plane (it advertises their addresses); a partition freezes all of them. Unlike
  netns, the worker's own outgoing connections to *other workers* are not cut.

:func:`start_partitionable_cluster` starts a :class:`~rallypoint.cluster.local.LocalCluster`
either way and returns a :class:`PartitionControl` (``partition``/``heal``/``close``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import socket
import struct
import subprocess
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from rallypoint.basics.errors import ConfigError, RallypointError
from rallypoint.etcd.server import free_port
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig, WorkerNetwork
from rallypoint.basics.logs import get_logger

log = get_logger("rallypoint.chaos.network")

POOL = ipaddress.IPv4Network("10.64.0.0/10")  # each NetnsNetwork takes a random /16 of it
BR_STATE_FORWARDING = "3"  # /sys/class/net/PORT/brport/state (include/uapi/linux/if_bridge.h)
_GONE = ("cannot find device", "no such file", "does not exist", "not found")


class NetworkError(RallypointError):
    """An ``ip`` command failed; ``command`` and ``stderr`` say which and why."""

    def __init__(self, command: Sequence[str], stderr: str) -> None:
        super().__init__(f"`{' '.join(command)}` failed: {stderr.strip() or '(no output)'}")
        self.command = list(command)
        self.stderr = stderr


def ip(*args: str) -> str:
    """Run ``ip ARGS`` (check=True); its stdout. NetworkError names the command and its stderr."""
    cmd = ["ip", *args]
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout
    except subprocess.CalledProcessError as exc:
        raise NetworkError(cmd, exc.stderr or "") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkError(cmd, str(exc)) from None


def _delete(kind: str, name: str) -> None:
    """Delete a namespace or link; one that is already gone is fine."""
    try:
        ip(*(("netns", "delete", name) if kind == "netns" else ("link", "delete", name)))
    except NetworkError as exc:
        if not any(g in exc.stderr.lower() for g in _GONE):
            raise


def _teardown(namespaces: list[str], links: list[str]) -> list[str]:
    """Delete ``namespaces`` then ``links`` (emptying both lists); the errors, best effort."""
    errors = []
    for kind, names in (("netns", namespaces), ("link", links)):
        for name in reversed(list(names)):
            try:
                _delete(kind, name)
                names.remove(name)
            except NetworkError as exc:
                errors.append(str(exc))
    return errors


@dataclass(frozen=True)
class NetnsWorker:
    """One worker's namespace: its name, its address, the root-side veth end."""

    netns: str
    ip: str
    host_veth: str


class NetnsNetwork:
    """Network namespaces for the workers of one cluster (root only); see the module doc.

    Every name carries a random per-instance token and the subnet is a random free /16
    of 10.64.0.0/10, so two suites can run at once. Use it as a context manager or
    call :meth:`teardown`; what is left when the object is collected or the
    interpreter exits is deleted then (best effort).
    """

    def __init__(self, *, token: str | None = None) -> None:
        self.token = token or secrets.token_hex(3)
        self.bridge = f"rpbr{self.token}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.host_ip = ""
        self.workers: dict[str, NetnsWorker] = {}
        self._namespaces: list[str] = []
        self._links: list[str] = []
        self._finalizer = weakref.finalize(self, _teardown, self._namespaces, self._links)

    @staticmethod
    def available() -> bool:
        """True when this process is root and can create (and delete) a network namespace."""
        if os.geteuid() != 0 or shutil.which("ip") is None:
            return False
        probe = f"rp-probe-{secrets.token_hex(4)}"
        try:
            ip("netns", "add", probe)
        except NetworkError:
            return False
        try:
            _delete("netns", probe)
        except NetworkError:
            return False
        return True

    def _free_subnet(self) -> ipaddress.IPv4Network:
        used = []
        for line in (ip("-4", "-o", "addr", "show") + ip("-4", "route", "show", "table", "all")).splitlines():
            for word in line.split():
                with contextlib.suppress(ValueError):
                    if word[0].isdigit():
                        used.append(ipaddress.IPv4Network(word, strict=False))
        candidates = list(POOL.subnets(new_prefix=16))
        random.shuffle(candidates)
        for net in candidates:
            if not any(net.overlaps(u) for u in used):
                return net
        raise NetworkError(["ip", "addr"], f"no free /16 left in {POOL}")

    def setup(self) -> str:
        """Create the bridge carrying the host address; return that address."""
        if self.host_ip:
            return self.host_ip
        self.subnet = self._free_subnet()
        host = f"{self.subnet.network_address + 1}/{self.subnet.prefixlen}"
        ip("link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        ip("addr", "add", host, "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        self.host_ip = str(self.subnet.network_address + 1)
        log.info("netns.setup", bridge=self.bridge, host_ip=self.host_ip, subnet=str(self.subnet))
        return self.host_ip

    def add_worker(self, name: str) -> tuple[str, str]:
        """Give worker ``name`` a namespace (again the same one if it has one); ``(netns, ip)``."""
        if name in self.workers:
            w = self.workers[name]
            return w.netns, w.ip
        if self.subnet is None:
            raise ConfigError("NetnsNetwork.setup() must run before add_worker()")
        k = len(self.workers) + 1
        if k > 254:
            raise ConfigError("a NetnsNetwork holds at most 254 workers")
        w = NetnsWorker(netns=f"rp-{self.token}-{name}", ip=str(self.subnet.network_address + 256 * k + 2),
                        host_veth=f"rpv{self.token}{k}")
        ip("netns", "add", w.netns)
        self._namespaces.append(w.netns)
        ip("link", "add", w.host_veth, "type", "veth", "peer", "name", "eth0", "netns", w.netns)
        self._links.append(w.host_veth)
        ip("link", "set", w.host_veth, "master", self.bridge)
        ip("link", "set", w.host_veth, "up")
        ip("-n", w.netns, "addr", "add", f"{w.ip}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", w.netns, "link", "set", "eth0", "up")
        ip("-n", w.netns, "link", "set", "lo", "up")
        ip("-n", w.netns, "route", "add", "default", "via", self.host_ip)
        self.workers[name] = w
        log.info("netns.worker_added", worker=name, netns=w.netns, ip=w.ip, veth=w.host_veth)
        return w.netns, w.ip

    def _worker(self, name: str) -> NetnsWorker:
        if name not in self.workers:
            raise ConfigError(f"worker {name!r} has no namespace here; known: {sorted(self.workers)}")
        return self.workers[name]

    def partition(self, name: str) -> None:
        """Cut worker ``name`` off in both directions (its root-side veth down)."""
        ip("link", "set", self._worker(name).host_veth, "down")
        log.info("netns.partitioned", worker=name)

    def heal(self, name: str, *, timeout_s: float = 10.0) -> None:
        """Undo :meth:`partition`; returns once the path carries packets again.

        Setting the link up is not enough. When the partitioned worker was the bridge's only
        port up, the bridge lost its carrier and drops what the host sends until the kernel's
        link-watch work turns the carrier back on, which it defers by up to a second after the
        previous link event (measured 0.7 s here; more on a loaded host). A SYN-ACK dropped
        then is resent only a second later. So wait until the port forwards, both veth ends
        and the bridge are up. NetworkError after ``timeout_s``.
        """
        w = self._worker(name)
        ip("link", "set", w.host_veth, "up")
        deadline = time.monotonic() + timeout_s
        while not self._forwarding(w):
            if time.monotonic() > deadline:
                raise NetworkError(["ip", "link", "set", w.host_veth, "up"],
                                   f"the link of worker {name!r} did not come up within {timeout_s} s")
            time.sleep(0.02)
        log.info("netns.healed", worker=name)

    def _forwarding(self, w: NetnsWorker) -> bool:
        """Whether the bridge forwards on ``w``'s port and the bridge and both ends of the veth are up."""
        sys_net = Path("/sys/class/net")
        try:
            port_state = (sys_net / w.host_veth / "brport" / "state").read_text().strip()
            up = [(sys_net / d / "operstate").read_text().strip() == "up" for d in (w.host_veth, self.bridge)]
        except OSError:
            return False
        return port_state == BR_STATE_FORWARDING and all(up) and "state UP" in ip("-n", w.netns, "-o", "link",
                                                                                   "show", "eth0")

    def teardown(self) -> None:
        """Delete exactly the namespaces and links this instance created (idempotent).

        Tries every one even when some fail, then raises NetworkError listing the failures.
        """
        errors = _teardown(self._namespaces, self._links)
        self.workers.clear()
        if errors:
            raise NetworkError(["ip", "netns/link", "delete"], "; ".join(errors))
        log.info("netns.teardown", token=self.token)

    def __enter__(self) -> NetnsNetwork:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()


class _Pair:
    """One proxied connection: the accepted socket and the one to the target."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.socks = (client, upstream)
        self.dead = threading.Event()
        self._lock = threading.Lock()
        self._running = 2  # pump threads, one per direction

    def kill(self) -> None:
        with self._lock:
            if self.dead.is_set():
                return
            self.dead.set()
        for s in self.socks:
            _reset(s)

    def pump_done(self) -> bool:
        """One direction finished; True (and both sockets closed) when it was the last."""
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            for s in self.socks:
                with contextlib.suppress(OSError):
                    s.close()
        return last


def _reset(s: socket.socket) -> None:
    """Close ``s`` with a RST (linger 0); wakes a thread blocked reading it."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        s.close()


class TcpProxy:
    """A TCP proxy on a free 127.0.0.1 port forwarding to ``target`` (threads and sockets).

    :meth:`cut` resets every open connection and black-holes new ones (accepted, never
    forwarded, reset on :meth:`restore`). ``cut(freeze=True)`` is the partition-like
    variant: open connections stay open but nothing moves in either direction, new
    ones hang, and :meth:`restore` lets all of them flow again (as TCP does after a
    healed partition). ``target`` may be changed while it runs (new connections go
    there). Counters: ``forwarded`` (connections), ``dropped`` (connections accepted
    while cut), ``cuts``.
    """

    def __init__(self, target: tuple[str, int] | str, *, host: str = "127.0.0.1") -> None:
        if isinstance(target, str):
            thost, _, tport = target.rpartition(":")
            target = (thost, int(tport))
        self.target = target
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.2)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self.cut_now = False
        self.frozen = False
        self.forwarded = self.dropped = self.cuts = 0
        self._flowing = threading.Event()
        self._flowing.set()
        self._pairs: set[_Pair] = set()
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"proxy-{self.address}", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                if self.cut_now or self._closed.is_set():
                    self._held.append(conn)
                    self.dropped += 1
                    continue
            threading.Thread(target=self._open, args=(conn,), daemon=True).start()

    def _open(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=2.0)
        except OSError:
            _reset(conn)
            return
        pair = _Pair(conn, upstream)
        with self._lock:
            if (self.cut_now and not self.frozen) or self._closed.is_set():
                pair.kill()
                return
            self._pairs.add(pair)
            self.forwarded += 1
        for sock in pair.socks:
            sock.settimeout(0.2)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._pump, args=(pair, conn, upstream), daemon=True).start()
        self._pump(pair, upstream, conn)

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not pair.dead.is_set():
                if not self._flowing.wait(0.2):
                    continue  # frozen: leave the bytes where they are
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    if not pair.dead.is_set():
                        with contextlib.suppress(OSError):
                            dst.shutdown(socket.SHUT_WR)  # pass the half-close on
                    return
                view = memoryview(data)
                while view:
                    if pair.dead.is_set():
                        return
                    if not self._flowing.wait(0.2):
                        continue
                    try:
                        view = view[dst.send(view):]
                    except TimeoutError:
                        continue
        except OSError:
            pair.kill()
        finally:
            if pair.pump_done() or pair.dead.is_set():
                with self._lock:
                    self._pairs.discard(pair)

    def cut(self, *, freeze: bool = False) -> None:
        """Reset every open connection (``freeze``: stall it) and black-hole new ones until :meth:`restore`."""
        with self._lock:
            self.cut_now, self.frozen = True, freeze
            self.cuts += 1
            self._flowing.clear()
            pairs = [] if freeze else list(self._pairs)
            if not freeze:
                self._pairs = set()
        for p in pairs:
            p.kill()
        if not freeze:
            self._flowing.set()  # nothing is left open to stall

    def restore(self) -> None:
        """Forward again. Connections accepted while cut are reset, or (after a freeze) forwarded."""
        with self._lock:
            frozen = self.frozen and not self._closed.is_set()
            self.cut_now = self.frozen = False
            held, self._held = self._held, []
            self._flowing.set()
        for conn in held:
            if frozen:
                threading.Thread(target=self._open, args=(conn,), daemon=True).start()
            else:
                _reset(conn)

    def close(self) -> None:
        """Stop listening and reset everything (idempotent)."""
        self._closed.set()
        self.cut()
        self.restore()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(timeout=2)


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
