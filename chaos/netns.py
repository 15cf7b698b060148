"""Linux network namespaces that cut single workers of a local cluster off (root only).

:class:`NetnsNetwork`: every worker runs in its own network namespace, joined by a
veth pair to a bridge in the root namespace that carries the host address etcd and the
coordinators listen on. Partitioning a worker takes the root-side end of its veth
down: nothing passes in either direction, open connections hang, new ones time out,
exactly as a pulled cable.

(A bridge rather than a dummy link plus per-worker routes: worker-to-worker traffic
then stays on one L2 segment and needs no ``net.ipv4.ip_forward``, a global sysctl
this module should not flip, and which is 0 here.)

Every change goes through the ``ip`` command (:func:`ip`); a failure is a
:class:`NetworkError` naming the command and its stderr. The partition interface
over this is :class:`rallypoint.chaos.network.NetnsPartitions`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import subprocess
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rallypoint.basics.errors import ConfigError, RallypointError
from rallypoint.basics.logs import get_logger

log = get_logger("rallypoint.chaos.network")

POOL = ipaddress.IPv4Network("10.64.0.0/10")  # each NetnsNetwork takes a random /16 of it
BR_STATE_FORWARDING = "3"  # /sys/class/net/PORT/brport/state (include/uapi/linux/if_bridge.h)
# What ``ip`` says of a namespace or link that is gone. "No such device" comes when the
# kernel removes a veth between our lookup and our delete: deleting a namespace takes the
# peer of each veth in it with it, asynchronously.
_GONE = ("cannot find device", "no such device", "no such file", "does not exist", "not found")


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
