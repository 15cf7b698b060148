"""The embedded local cluster: etcd, coordinators and workers as real processes.

``rallypoint up`` starts one in the background and records every process it
started (pid and kernel start time) in ``<state-dir>/cluster.json``;
``rallypoint down`` stops exactly those processes and no others (a pid reused
by an unrelated process has another start time and is left alone). Tests use
the same class in-process.

Networks (``LocalClusterConfig.network``): ``loopback`` (every process on
127.0.0.1); ``netns`` and ``proxy`` put each worker where the chaos harness can
cut it off (``chaos/network.py``). This module knows nothing of namespaces or
proxies: etcd and coordinators bind ``config.host``, and a ``worker_network``
hook (:data:`WorkerNetworkHook`) says, per worker, what to run the worker under,
where it binds, how it reaches etcd and what it advertises.

Security (``LocalClusterConfig.tls``, on by default; ``docs/security.md``): the cluster
keeps a CA in ``<state-dir>/tls`` and gives every process its own certificate (made
afresh at each start of the process, naming the addresses it binds and advertises);
etcd runs with TLS and client-certificate auth, and a ``rallypoint`` user that may only
touch this cluster's prefix; every daemon gets ``--tls-dir``. Clients (the CLI, tests)
use the ``client`` certificate.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rallypoint.cluster.certs import DEFAULT_HOSTS, issue
from rallypoint.basics import tls as tls_registry
from rallypoint.etcd.auth import enable_auth
from rallypoint.etcd.cluster_view import ClusterSnapshot, read_cluster
from rallypoint.basics.errors import ClusterNotFound, ConfigError, RallypointError, StoreError
from rallypoint.etcd.server import EtcdCluster
from rallypoint.etcd.keys import Keys, check_name
from rallypoint.basics.logs import get_logger
from rallypoint.etcd.metrics_targets import read_metrics_targets
from rallypoint.etcd.store import EtcdStore
from rallypoint.basics.tls import TlsConfig
from rallypoint.orchestrator.hooks import ExecutorHooks
from rallypoint.workers.faults import NO_FAULTS, WorkerFaults

STATE_FILE = "cluster.json"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
NETWORKS = ("loopback", "netns", "proxy")
DEFAULT_HOST = "127.0.0.1"
TLS_DIR = "tls"
CLIENT_CERT = "client"  # the identity the CLI and in-process clients use
ETCD_CERT = "etcd"


@dataclass(frozen=True, kw_only=True)
class LocalClusterConfig:
    """Shape of a local cluster.

    Attributes:
        state_dir: where etcd data, logs and ``cluster.json`` live.
        workers: workers meant to hold job slices.
        spares: extra workers kept free for recovery.
        devices_per_worker: K, the JAX CPU devices of each worker.
        coordinators: coordinator processes (one leads, the others stand by).
        etcd_members: 1 or 3.
        lease_ttl_s: worker and leader lease TTL. The embedded etcd runs with a
            50 ms heartbeat and 500 ms election timeout, so 1 s is allowed.
        cluster: cluster name.
        network: ``loopback`` (default), ``netns`` (each worker in its own network
            namespace) or ``proxy`` (each worker behind TCP proxies); the last two need
            a ``worker_network`` hook, see ``chaos.network.start_partitionable_cluster``.
        host: the IPv4 address etcd and the coordinators bind and advertise; with
            ``netns`` an address of the root namespace the workers can reach.
        compile_cache_dir: JAX's persistent compilation cache, shared by every worker
            (``--compile-cache-dir``): None puts it at ``<state_dir>/compile-cache`` (kept
            across ``down`` and ``up``), "" turns it off.
        preempt_deadline_s: how long a worker's preemption notice (SIGTERM) gives the
            leader to drain it before it leaves anyway (``--preempt-deadline-s``).
        suspect_after_s: the leader fences a worker whose heartbeats stopped this long
            (``--suspect-after-s``; 0: hangs are found by the lease TTL only).
        worker_faults: test fault hooks every worker starts with (hidden ``--fault-*``
            options, :mod:`rallypoint.workers.faults`); none by default.
        coordinator_hooks: test fault hooks every coordinator starts with (hidden
            ``--test-*`` options, :class:`rallypoint.orchestrator.hooks.ExecutorHooks`); none by default.
        tls: mutual TLS everywhere and etcd auth (the default); False runs every process
            ``--insecure`` (plain TCP, etcd without auth): ``rallypoint up --insecure``.
        metrics: every coordinator and worker serves Prometheus metrics on a free port
            (``--metrics-port 0``); each publishes the address in its etcd record, where
            :meth:`LocalCluster.metrics_targets` and ``rallypoint metrics`` find it (docs/metrics.md).
    """

    state_dir: Path
    workers: int = 2
    spares: int = 1
    devices_per_worker: int = 2
    coordinators: int = 2
    etcd_members: int = 1
    lease_ttl_s: int = 2
    cluster: str = "local"
    network: str = "loopback"
    host: str = DEFAULT_HOST
    compile_cache_dir: str | Path | None = None
    preempt_deadline_s: float = 30.0
    suspect_after_s: float = 1.0
    worker_faults: WorkerFaults = NO_FAULTS
    coordinator_hooks: ExecutorHooks = ExecutorHooks()
    tls: bool = True
    metrics: bool = True

    def __post_init__(self) -> None:
        check_name("cluster", self.cluster)
        if self.network not in NETWORKS:
            raise ConfigError(f"network must be one of {', '.join(NETWORKS)}, got {self.network!r}")
        try:
            addr = ipaddress.IPv4Address(self.host)
        except ValueError:
            raise ConfigError(f"host must be an IPv4 address (etcd and coordinators bind it), "
                              f"got {self.host!r}") from None
        if self.network == "netns" and addr.is_loopback:
            raise ConfigError(f"network='netns' needs a host address the namespaces can reach, not {self.host}: "
                              "use chaos.network.start_partitionable_cluster, which sets it")
        for name in ("workers", "devices_per_worker", "coordinators"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.spares < 0:
            raise ConfigError(f"--spares must be 0 or more, got {self.spares}")
        if self.etcd_members not in (1, 3):
            raise ConfigError(f"--etcd-members must be 1 or 3, got {self.etcd_members}")
        if self.lease_ttl_s < 1:
            raise ConfigError(f"--lease-ttl-s must be at least 1, got {self.lease_ttl_s}")
        if self.preempt_deadline_s < 0:
            raise ConfigError(f"--preempt-deadline-s must be 0 or more, got {self.preempt_deadline_s:g}")
        if self.suspect_after_s < 0:
            raise ConfigError(f"--suspect-after-s must be 0 (off) or more, got {self.suspect_after_s:g}")


@dataclass(frozen=True, kw_only=True)
class WorkerNetwork:
    """Where one worker process lives on the network (what a ``worker_network`` hook returns).

    Attributes:
        prefix: argv the worker command runs under, e.g. ``("ip", "netns", "exec", NS)``.
            It must exec the command in place (same pid, as ``ip netns exec`` does):
            the cluster records and stops that pid.
        host: address the worker's gRPC server and data plane bind.
        endpoints: etcd endpoints as this worker reaches them (empty: the cluster's).
        port, data_port: ports to bind (0: free ones).
        advertise_address, advertise_data_address: ``host:port`` others reach the worker
            at, when not where it binds ("" advertises the bound address).
    """

    prefix: tuple[str, ...] = ()
    host: str = DEFAULT_HOST
    endpoints: tuple[str, ...] = ()
    port: int = 0
    data_port: int = 0
    advertise_address: str = ""
    advertise_data_address: str = ""

    def args(self) -> list[str]:
        """The ``rallypoint worker`` options this placement adds (none for the defaults)."""
        out: list[str] = []
        for opt, value, default in (("--host", self.host, DEFAULT_HOST), ("--port", self.port, 0),
                                    ("--data-port", self.data_port, 0),
                                    ("--advertise-address", self.advertise_address, ""),
                                    ("--advertise-data-address", self.advertise_data_address, "")):
            if value != default:
                out += [opt, str(value)]
        return out


WorkerNetworkHook = Callable[[str, Sequence[str]], WorkerNetwork]
"""``(worker name, the cluster's etcd endpoints) -> WorkerNetwork``; called before every
start of that worker (also a restart), so it must give the same worker the same place."""


@dataclass
class ProcessRecord:
    """A process the cluster started: enough to find and stop exactly it."""

    role: str
    name: str
    pid: int
    start_time: int
    log: str
    argv: list[str] = field(default_factory=list)


def process_start_time(pid: int) -> int | None:
    """The kernel start time of ``pid`` (clock ticks since boot), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def is_running(rec: ProcessRecord) -> bool:
    """Whether the recorded process (same pid *and* start time) still runs."""
    return process_start_time(rec.pid) == rec.start_time


def stop_process(rec: ProcessRecord, *, grace_s: float = 5.0, sig: int = signal.SIGINT) -> None:
    """Stop one recorded process: ``sig``, then SIGKILL after ``grace_s``. Reaps it if it is our child.

    SIGINT, not SIGTERM: a worker takes SIGTERM as a preemption notice and first waits to be drained.
    """
    if not is_running(rec):
        _reap(rec.pid)
        return
    try:
        os.kill(rec.pid, sig)
        os.kill(rec.pid, signal.SIGCONT)  # a stopped process must run to handle the signal
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(rec.pid)
        if not is_running(rec):
            return
        time.sleep(0.05)
    try:
        os.kill(rec.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    for _ in range(100):
        _reap(rec.pid)
        if not is_running(rec):
            return
        time.sleep(0.02)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


class LocalCluster:
    """A running local cluster (started here, or loaded from its state dir)."""

    def __init__(self, config: LocalClusterConfig, endpoints: list[str], processes: list[ProcessRecord], *,
                 worker_network: WorkerNetworkHook | None = None,
                 worker_networks: dict[str, WorkerNetwork] | None = None) -> None:
        self.config = config
        self.endpoints = endpoints
        self.processes = processes
        self.worker_network = worker_network
        self.worker_networks: dict[str, WorkerNetwork] = dict(worker_networks or {})
        self.keys = Keys(config.cluster)
        self.etcd: EtcdCluster | None = None
        self._popen: dict[str, subprocess.Popen[bytes]] = {}
        self.log = get_logger("rallypoint.local_cluster", cluster=config.cluster)
        if config.tls:  # in-process clients (EtcdStore(endpoints), submit) find the identity by the endpoints
            d = self.tls_dir
            tls_registry.remember(endpoints,
                                  TlsConfig(d / "ca.crt", d / f"{CLIENT_CERT}.crt", d / f"{CLIENT_CERT}.key"))

    # -- starting ---------------------------------------------------------------------

    @classmethod
    def start(cls, config: LocalClusterConfig, *, wait_s: float = 90.0,
              worker_network: WorkerNetworkHook | None = None) -> LocalCluster:
        """Start etcd, coordinators and workers; return once every worker is registered.

        Args:
            worker_network: places each worker on the network; required unless
                ``config.network`` is ``loopback``.

        Raises:
            ConfigError: a ``netns``/``proxy`` network without ``worker_network``.
            RallypointError: a cluster of this state dir still runs, or it did not come up.
        """
        if config.network != "loopback" and worker_network is None:
            raise ConfigError(f"network={config.network!r} needs a worker_network hook: start the cluster with "
                              "chaos.network.start_partitionable_cluster")
        state = config.state_dir
        existing = state / STATE_FILE
        if existing.exists():
            old = cls.load(state)
            if any(is_running(p) for p in old.processes):
                raise RallypointError(
                    f"a cluster started from {state} is still running; stop it with "
                    f"`rallypoint down --state-dir {state}` or use another --state-dir"
                )
            existing.unlink()
        state.mkdir(parents=True, exist_ok=True)
        for sub in ("etcd", "logs"):
            shutil.rmtree(state / sub, ignore_errors=True)
        (state / "logs").mkdir()
        tls_dir = state / TLS_DIR
        hosts = list(dict.fromkeys([config.host, *DEFAULT_HOSTS]))
        etcd_tls = issue(tls_dir, ETCD_CERT, hosts=hosts, cluster=config.cluster) if config.tls else None
        client_tls = issue(tls_dir, CLIENT_CERT, hosts=hosts, cluster=config.cluster) if config.tls else None
        etcd = EtcdCluster.start(members=config.etcd_members, base_dir=state / "etcd", host=config.host, tls=etcd_tls)
        etcd.detach()
        if client_tls is not None:
            try:
                enable_auth(etcd.endpoints, client_tls, Keys(config.cluster).prefix, secrets_dir=state / "etcd")
            except BaseException:
                etcd.stop()
                raise
        processes = [
            ProcessRecord("etcd", m.name, m.pid or 0, process_start_time(m.pid or 0) or 0, str(m.log_path))
            for m in etcd.members
        ]
        cluster = cls(config, etcd.endpoints, processes, worker_network=worker_network)
        cluster.etcd = etcd  # the in-process handle: tests stop and restart members through it
        try:
            for i in range(config.coordinators):
                cluster.spawn("coordinator", f"c{i}")
            for i in range(config.workers + config.spares):
                cluster.spawn("worker", f"w{i}")
            cluster.save()
            cluster.wait_for_workers(config.workers + config.spares, timeout_s=wait_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def argv(self, role: str, name: str, net: WorkerNetwork | None = None) -> list[str]:
        """The command line of one coordinator or worker (``net``: the worker's placement)."""
        endpoints = list(net.endpoints) if net is not None and net.endpoints else self.endpoints
        base = [*(net.prefix if net is not None else ()), sys.executable, "-m", "rallypoint.cluster.daemons", role,
                "--cluster", f"{self.config.cluster}@{','.join(endpoints)}",
                "--id", name, "--lease-ttl-s", str(self.config.lease_ttl_s)]
        base += ["--tls-dir", str(self.tls_dir)] if self.config.tls else ["--insecure"]
        base += ["--metrics-port", "0"] if self.config.metrics else []  # docs/metrics.md
        if role == "worker":
            base += ["--devices", str(self.config.devices_per_worker),
                     "--preempt-deadline-s", f"{self.config.preempt_deadline_s:g}"]
            base += net.args() if net is not None else []
            if self.compile_cache_dir is not None:
                base += ["--compile-cache-dir", str(self.compile_cache_dir)]
            base += self.config.worker_faults.args()
        else:
            base += ["--checkpoint-dir", str(self.checkpoint_dir),
                     "--suspect-after-s", f"{self.config.suspect_after_s:g}"]
            if self.config.host != DEFAULT_HOST:
                base += ["--host", self.config.host]
            if self.config.coordinator_hooks.skip_replay:
                base += ["--test-skip-replay"]
        return base

    def _place(self, name: str) -> WorkerNetwork | None:
        if self.worker_network is None:
            if self.config.network != "loopback":
                raise ConfigError(f"this cluster runs network={self.config.network!r}: only the process that "
                                  "started it (holding its worker_network hook) can start a worker")
            return None
        net = self.worker_network(name, tuple(self.endpoints))
        self.worker_networks[name] = net
        return net

    @property
    def tls_dir(self) -> Path:
        """The cluster's CA and per-process certificates."""
        return (self.config.state_dir / TLS_DIR).absolute()

    @property
    def client_tls(self) -> TlsConfig | None:
        """The identity clients of this cluster use (None: an ``--insecure`` cluster)."""
        if not self.config.tls:
            return None
        return TlsConfig.from_dir(self.tls_dir, CLIENT_CERT)

    def _issue(self, name: str, net: WorkerNetwork | None) -> None:
        """A fresh certificate for process ``name``, naming every address it binds or is reached at."""
        hosts = [self.config.host, *DEFAULT_HOSTS]
        if net is not None:
            advertised = (net.advertise_address, net.advertise_data_address)
            hosts += [net.host] + [a.rpartition(":")[0] for a in advertised if a]
        issue(self.tls_dir, name, hosts=list(dict.fromkeys(hosts)), cluster=self.config.cluster)

    @property
    def checkpoint_dir(self) -> Path:
        """Where this cluster's jobs keep checkpoints (kept across ``down`` and ``up``)."""
        return (self.config.state_dir / "checkpoints").absolute()

    @property
    def compile_cache_dir(self) -> Path | None:
        """The compilation cache every worker shares (kept across ``down`` and ``up``); None: no cache."""
        d = self.config.compile_cache_dir
        if d is None:
            return (self.config.state_dir / "compile-cache").absolute()
        return Path(d).absolute() if str(d) else None

    def spawn(self, role: str, name: str, *, extra_env: dict[str, str] | None = None) -> ProcessRecord:
        """Start one coordinator or worker process and record it."""
        log_path = self.config.state_dir / "logs" / f"{name}.log"
        net = self._place(name) if role == "worker" else None
        if self.config.tls:
            self._issue(name, net)
        argv = self.argv(role, name, net)
        env = os.environ | {"PYTHONUNBUFFERED": "1"} | (extra_env or {})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=env, cwd=str(PROJECT_ROOT),
            )
        rec = ProcessRecord(role, name, proc.pid, process_start_time(proc.pid) or 0, str(log_path), argv)
        self._popen[name] = proc
        self.processes = [p for p in self.processes if p.name != name] + [rec]
        self.save()
        self.log.info("process.started", role=role, name=name, pid=proc.pid)
        return rec

    def wait_for_workers(self, count: int, *, timeout_s: float = 60.0) -> ClusterSnapshot:
        """Wait until ``count`` workers are registered; fail with their logs' tails if not."""
        deadline = time.monotonic() + timeout_s
        store = self.store()
        try:
            while True:
                try:
                    snap = read_cluster(store, self.keys)
                    if len(snap.workers) >= count:
                        return snap
                except StoreError:
                    pass
                dead = [p for p in self.processes if p.role != "etcd" and not is_running(p)]
                if dead or time.monotonic() > deadline:
                    tails = "\n".join(f"--- {p.name} ({p.log})\n{_tail(p.log)}" for p in (dead or self.processes))
                    why = f"{', '.join(p.name for p in dead)} exited" if dead else f"timed out after {timeout_s}s"
                    raise RallypointError(f"local cluster did not come up: {why}\n{tails}")
                time.sleep(0.2)
        finally:
            store.close()

    def leader_dashboard(self, *, timeout_s: float = 15.0) -> str | None:
        """The leader's dashboard address (docs/dashboard.md), once a leader published one; None if none did."""
        deadline = time.monotonic() + timeout_s
        store = self.store()
        try:
            while True:
                try:
                    kv = store.get(self.keys.leader)
                    url = kv.json().get("dashboard") if kv is not None else None
                    if url:
                        return str(url)
                except StoreError:
                    pass
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.1)
        finally:
            store.close()

    # -- persistence --------------------------------------------------------------------

    def save(self) -> None:
        data = {
            "cluster": self.config.cluster,
            "endpoints": self.endpoints,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.config).items()},
            "processes": [asdict(p) for p in self.processes],
        }
        if self.worker_networks:
            data["worker_networks"] = {w: asdict(n) for w, n in self.worker_networks.items()}
        path = self.config.state_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, state_dir: Path) -> LocalCluster:
        """The cluster recorded in ``state_dir``; ClusterNotFound if none is."""
        path = state_dir / STATE_FILE
        if not path.exists():
            raise ClusterNotFound(
                f"no cluster recorded in {state_dir}: start one with `rallypoint up --state-dir {state_dir}`, "
                "or pass --cluster NAME@HOST:PORT"
            )
        data = json.loads(path.read_text())
        cfg: dict[str, Any] = data["config"] | {"state_dir": Path(data["config"]["state_dir"])}
        if "worker_faults" in cfg:
            cfg["worker_faults"] = WorkerFaults(**cfg["worker_faults"])
        if "coordinator_hooks" in cfg:
            cfg["coordinator_hooks"] = ExecutorHooks(**cfg["coordinator_hooks"])
        nets = {w: WorkerNetwork(**(n | {"prefix": tuple(n["prefix"]), "endpoints": tuple(n["endpoints"])}))
                for w, n in data.get("worker_networks", {}).items()}
        return cls(LocalClusterConfig(**cfg), data["endpoints"], [ProcessRecord(**p) for p in data["processes"]],
                   worker_networks=nets)

    # -- using and stopping -------------------------------------------------------------------

    def store(self) -> EtcdStore:
        return EtcdStore(self.endpoints, tls=self.client_tls)

    def metrics_targets(self) -> list[dict[str, Any]]:
        """Every live coordinator's and worker's Prometheus endpoint, from etcd (``read_metrics_targets``)."""
        store = self.store()
        try:
            return read_metrics_targets(store, self.keys)
        finally:
            store.close()

    def process(self, name: str) -> ProcessRecord:
        for p in self.processes:
            if p.name == name:
                return p
        raise RallypointError(f"no process named {name!r} in this cluster")

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to the recorded process ``name`` (only if it is still that process)."""
        rec = self.process(name)
        if not is_running(rec):
            raise RallypointError(f"process {name!r} (pid {rec.pid}) is not running")
        os.kill(rec.pid, sig)
        if sig == signal.SIGKILL:
            self.reap(name)

    def reap(self, name: str, timeout_s: float = 5.0) -> None:
        proc = self._popen.get(name)
        if proc is not None:
            proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        """Stop every recorded process: workers, then coordinators, then etcd. Idempotent."""
        order = {"worker": 0, "coordinator": 1, "etcd": 2}
        for rec in sorted(self.processes, key=lambda p: order.get(p.role, 3)):
            stop_process(rec)
            proc = self._popen.get(rec.name)
            if proc is not None:
                try:
                    proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
        if self.etcd is not None:
            self.etcd.stop()
        tls_registry.remember(self.endpoints, None)
        path = self.config.state_dir / STATE_FILE
        if path.exists():
            path.unlink()
        self.log.info("cluster.stopped", processes=len(self.processes))


def _tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
