"""The embedded local cluster: etcd, coordinators and workers as real processes.

``rallypoint up`` starts one in the background and records every process it
started (pid and kernel start time) in ``<state-dir>/cluster.json``;
``rallypoint down`` stops exactly those processes and no others (a pid reused
by an unrelated process has another start time and is left alone). Tests use
the same class in-process.

:class:`LocalCluster` is the launcher: it decides what runs (each daemon's command
line, its certificate, its place on the network) and in what order, and composes
the pieces that do the work, each in its own module:

* :mod:`rallypoint.cluster.local_config`: the cluster's shape (:class:`LocalClusterConfig`)
  and a worker's place on the network (:class:`WorkerNetwork`);
* :mod:`rallypoint.cluster.processes`: process supervision (start, find, signal, stop
  processes by pid and start time);
* :mod:`rallypoint.cluster.local_security`: certificates and etcd's users;
* :mod:`rallypoint.cluster.local_state`: the state file.

The names other code imports from here (the config, :func:`is_running`, ``STATE_FILE``
...) stay importable from here.

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

import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rallypoint.etcd.records import parsed
from rallypoint.basics.errors import ConfigError, RallypointError, StoreError
from rallypoint.basics.logs import get_logger
from rallypoint.basics.tls import TlsConfig
from rallypoint.cluster import local_security as security
from rallypoint.cluster.local_config import (DEFAULT_HOST, NETWORKS, LocalClusterConfig, WorkerNetwork,
                                            WorkerNetworkHook)
from rallypoint.cluster.local_devices import plan_devices
from rallypoint.cluster.local_state import STATE_FILE, read_state, state_file, write_state
from rallypoint.cluster import zygote_client as zygote
from rallypoint.cluster.processes import (PROJECT_ROOT, ProcessRecord, RestartPolicy, Supervisor, child_env,
                                          is_running, log_tail, process_start_time, stop_process)
from rallypoint.etcd.cluster_view import ClusterSnapshot, read_cluster
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.metrics_targets import read_metrics_targets
from rallypoint.etcd.server import EtcdCluster
from rallypoint.etcd.etcd_store import EtcdStore

DAEMONS = "rallypoint.cluster.daemons"

__all__ = [  # the launcher, and what its users import from here
    "DEFAULT_HOST", "NETWORKS", "STATE_FILE", "LocalCluster", "LocalClusterConfig", "ProcessRecord", "WorkerNetwork",
    "WorkerNetworkHook", "is_running", "process_start_time", "stop_process",
]


class LocalCluster:
    """A running local cluster (started here, or loaded from its state dir)."""

    def __init__(self, config: LocalClusterConfig, endpoints: list[str], processes: list[ProcessRecord], *,
                 worker_network: WorkerNetworkHook | None = None,
                 worker_networks: dict[str, WorkerNetwork] | None = None) -> None:
        self.config = config
        self.endpoints = endpoints
        self.supervisor = Supervisor(processes)
        self.worker_network = worker_network
        self.worker_networks: dict[str, WorkerNetwork] = dict(worker_networks or {})
        self.keys = Keys(config.cluster)
        self.etcd: EtcdCluster | None = None
        self.log = get_logger("rallypoint.local_cluster", cluster=config.cluster)
        self.restart_policy = RestartPolicy()
        self._supervising: tuple[threading.Thread, threading.Event] | None = None
        self._spawn_lock = threading.Lock()
        self._reported: set[str] = set()  # processes past their restart limit, logged once
        self.etcd_users: set[str] = set()  # workers whose etcd user this handle made (their restarts add none)
        self.zygote = next((p for p in processes if p.role == "zygote"), None)  # forks workers (cluster/zygote.py)
        # in-process clients (EtcdStore(endpoints), submit) find the identity (or plain) by the endpoints
        security.remember_client(endpoints, self.tls_dir if config.tls else None)

    @property
    def processes(self) -> list[ProcessRecord]:
        """Every process recorded (etcd members, coordinators, workers)."""
        return self.supervisor.records

    # -- starting ---------------------------------------------------------------------

    @classmethod
    def start(cls, config: LocalClusterConfig, *, wait_s: float = 90.0,
              worker_network: WorkerNetworkHook | None = None) -> LocalCluster:
        """Start etcd, coordinators and workers; return once every worker is registered and a coordinator leads
        (workers forked from the zygote come up before the coordinators, which import more: a cluster returned
        without a leader showed no coordinator to a scrape or a ``rallypoint workers`` at once).

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
        existing = state_file(state)
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
        forks = cls._start_zygote(config)  # first: it imports while etcd starts
        etcd_tls, client_tls = (security.issue_etcd_and_client(state, host=config.host, cluster=config.cluster)
                                if config.tls else (None, None))
        try:
            etcd = EtcdCluster.start(members=config.etcd_members, base_dir=state / "etcd", host=config.host,
                                     tls=etcd_tls)
        except BaseException:
            if forks is not None:
                stop_process(forks)
                zygote.remove_socket(forks.argv)
            raise
        etcd.detach()
        if client_tls is not None:
            security.enable_etcd_auth(etcd, client_tls, cluster=config.cluster, secrets_dir=state / "etcd",
                                      workers=[f"w{i}" for i in range(config.workers + config.spares)])
        processes = [
            ProcessRecord("etcd", m.name, m.pid or 0, process_start_time(m.pid or 0) or 0, str(m.log_path))
            for m in etcd.members
        ] + ([forks] if forks is not None else [])
        cluster = cls(config, etcd.endpoints, processes, worker_network=worker_network)
        cluster.etcd = etcd  # the in-process handle: tests stop and restart members through it
        if client_tls is not None:  # made with auth above: a spawn need not log in as root to find them there
            cluster.etcd_users.update(f"w{i}" for i in range(config.workers + config.spares))
        try:
            for i in range(config.coordinators):
                cluster.spawn("coordinator", f"c{i}")
            for i in range(config.workers + config.spares):
                cluster.spawn("worker", f"w{i}")
            cluster.save()
            deadline = time.monotonic() + wait_s
            cluster.wait_for_workers(config.workers + config.spares, timeout_s=wait_s)
            if config.coordinators:
                cluster.wait_for_leader(timeout_s=max(deadline - time.monotonic(), 1.0))
        except BaseException:
            cluster.stop()
            raise
        if config.supervise:
            cluster.supervise()
        return cluster

    @staticmethod
    def _start_zygote(config: LocalClusterConfig) -> ProcessRecord | None:
        """The zygote of a cluster whose workers it can fork (``config.zygote``; cpu, loopback), started."""
        if not (config.zygote and config.platform == "cpu" and config.network == "loopback"):
            return None
        sock = zygote.socket_dir() / zygote.SOCKET_NAME
        argv = [sys.executable, "-m", "rallypoint.cluster.zygote", str(sock)]
        helper = Supervisor([])
        return helper.launch("zygote", "zygote", argv, config.state_dir / "logs" / "zygote.log")

    def _fork(self, name: str, argv: list[str], log_path: Path) -> ProcessRecord | None:
        """Worker ``name`` forked by the zygote, recorded; None where it cannot (start it the usual way)."""
        z = self.zygote
        if z is None or argv[1:3] != ["-m", DAEMONS] or not is_running(z):
            return None
        try:
            pid = zygote.fork(Path(z.argv[-1]), argv[3:], env=child_env(), log=log_path, cwd=PROJECT_ROOT,
                              alive=lambda: is_running(z))
        except zygote.ZygoteError as exc:
            self.log.warning("zygote.failed", worker=name, error=str(exc))
            return None
        return self.supervisor.adopt("worker", name, pid, log_path, argv)

    def argv(self, role: str, name: str, net: WorkerNetwork | None = None) -> list[str]:
        """The command line of one coordinator or worker (``net``: the worker's placement)."""
        endpoints = list(net.endpoints) if net is not None and net.endpoints else self.endpoints
        base = [*(net.prefix if net is not None else ()), sys.executable, "-m", DAEMONS, role,
                "--cluster", f"{self.config.cluster}@{','.join(endpoints)}",
                "--id", name, "--lease-ttl-s", str(self.config.lease_ttl_s)]
        base += ["--tls-dir", str(security.process_tls_dir(self.tls_dir, name))] if self.config.tls else ["--insecure"]
        base += ["--metrics-port", "0"] if self.config.metrics else []  # docs/metrics.md
        if role == "worker":
            base += ["--devices", str(self.config.devices_per_worker), "--platform", self.config.platform,
                     "--preempt-deadline-s", f"{self.config.preempt_deadline_s:g}"]
            base += net.args() if net is not None else []
            base += ["--source-hide", str(self.tls_dir), "--source-hide", str(self.config.state_dir.absolute() / "etcd")]
            if self.compile_cache_dir is not None:
                base += ["--compile-cache-dir", str(self.compile_cache_dir)]
            base += ["--member-pool", str(self.config.member_pool)] if self.config.member_pool else []
            base += self.config.worker_faults.args()
        else:
            base += ["--checkpoint-dir", str(self.checkpoint_dir),
                     "--suspect-after-s", f"{self.config.suspect_after_s:g}"]
            if self.config.host != DEFAULT_HOST:
                base += ["--host", self.config.host]
            if self.config.coordinator_hooks.skip_replay:
                base += ["--test-skip-replay"]
            if self.config.coordinator_hooks.finish_gate:
                base += ["--test-finish-gate", self.config.coordinator_hooks.finish_gate]
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
        return security.cluster_tls_dir(self.config.state_dir)

    @property
    def client_tls(self) -> TlsConfig | None:
        """The identity clients of this cluster use (None: an ``--insecure`` cluster)."""
        if not self.config.tls:
            return None
        return security.client_tls(self.tls_dir)

    @property
    def checkpoint_dir(self) -> Path:
        """Where this cluster's jobs keep checkpoints (kept across ``down`` and ``up``)."""
        if self.config.checkpoint_dir:
            return Path(self.config.checkpoint_dir).absolute()
        return (self.config.state_dir / "checkpoints").absolute()

    def worker_env(self, name: str) -> dict[str, str] | None:
        """What worker ``name`` (``w<i>``) is started with beside this process's environment: its share of the host's
        devices on a GPU host (:func:`~rallypoint.cluster.local_devices.plan_devices`); None on cpu."""
        if self.config.platform == "cpu" or not name[1:].isdigit():
            return None
        plan = plan_devices(self.config.platform, processes=self.config.workers + self.config.spares,
                            devices_per_worker=self.config.devices_per_worker, host_devices=self.config.host_devices)
        i = int(name[1:])
        return dict(plan.env[i]) if i < len(plan.env) else None  # a worker added later shares the devices

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
        if role == "worker" and extra_env is None:
            extra_env = self.worker_env(name)
        if self.config.tls:
            security.issue_process(self.tls_dir, name, role=role, host=self.config.host, cluster=self.config.cluster,
                                   net=net)
            if role == "worker" and name not in self.etcd_users:
                # its own etcd user, confined to its own keys (etcd/auth.py)
                security.add_worker(self.endpoints, self.tls_dir, self.config.state_dir / "etcd",
                                    cluster=self.config.cluster, worker=name)
                self.etcd_users.add(name)
        with self._spawn_lock:
            argv = self.argv(role, name, net)
            rec = self._fork(name, argv, log_path) if role == "worker" and net is None and not extra_env else None
            rec = rec or self.supervisor.launch(role, name, argv, log_path, extra_env=extra_env)
            self.save()
        self.log.info("process.started", role=role, name=name, pid=rec.pid)
        return rec

    # -- supervision (LocalClusterConfig.supervise) -----------------------------------------------

    def supervise(self, *, poll_s: float = 0.2) -> None:
        """Restart coordinators and workers that die, from a thread of this process, until :meth:`stop`."""
        if self._supervising is not None:
            return
        stop = threading.Event()
        thread = threading.Thread(target=self.run_supervision, args=(stop,), kwargs={"poll_s": poll_s},
                                  name=f"supervise-{self.config.cluster}", daemon=True)
        self._supervising = (thread, stop)
        thread.start()

    def run_supervision(self, stop: threading.Event, *, poll_s: float = 0.2) -> None:
        """The supervision loop (a thread here, or the ``supervise`` daemon after ``rallypoint up``)."""
        while not stop.wait(poll_s):
            try:
                restarted = self.supervisor.restart_exited(
                    time.monotonic(), lambda r: self.spawn(r.role, r.name), self.restart_policy)
            except Exception as exc:  # a failed start is tried again on the next pass, after its backoff
                self.log.warning("process.restart_failed", error=repr(exc))
                continue
            for dead, new in restarted:
                self.log.warning("process.restarted", role=new.role, name=new.name, old_pid=dead.pid, pid=new.pid,
                                 restarts=len(self.supervisor.restarts.get(new.name, [])))
            for name, why in self.supervisor.given_up.items():
                if name not in self._reported:
                    self._reported.add(name)
                    self.log.error("process.restart_limit", name=name, reason=why)

    def detach_supervision(self) -> ProcessRecord | None:
        """Hand supervision to a ``supervise`` daemon that outlives this process (``rallypoint up``)."""
        if not self.config.supervise:
            return None
        self._end_supervision()
        argv = [sys.executable, "-m", "rallypoint.cluster.daemons", "supervise",
                "--state-dir", str(self.config.state_dir.absolute())]
        with self._spawn_lock:
            rec = self.supervisor.launch("supervisor", "supervisor", argv,
                                         self.config.state_dir / "logs" / "supervisor.log")
            self.save()
        return rec

    def _end_supervision(self) -> None:
        if self._supervising is not None:
            thread, stop = self._supervising
            stop.set()
            thread.join(timeout=30)
            self._supervising = None

    def wait_for_workers(self, count: int, *, timeout_s: float = 60.0) -> ClusterSnapshot:
        """Wait until ``count`` workers are registered; fail with their logs' tails if not."""
        def registered(store: EtcdStore) -> ClusterSnapshot | None:
            snap = read_cluster(store, self.keys)
            return snap if len(snap.workers) >= count else None

        def exited(dead: list[ProcessRecord]) -> tuple[list[ProcessRecord], str]:
            return dead, f"{', '.join(p.name for p in dead)} exited"

        return self._wait_up(registered, timeout_s=timeout_s, late=f"timed out after {timeout_s}s", lost=exited,
                             interval_s=0.2)

    def wait_for_leader(self, *, timeout_s: float = 60.0) -> None:
        """Wait until a coordinator leads; fail with the coordinators' logs' tails if none does in time."""
        def all_exited(dead: list[ProcessRecord]) -> tuple[list[ProcessRecord], str]:
            gone = [p for p in dead if p.role == "coordinator"]
            return (gone, "every coordinator exited") if len(gone) == self.config.coordinators else ([], "")

        self._wait_up(lambda store: store.get(self.keys.leader), timeout_s=timeout_s,
                      late=f"no coordinator led within {timeout_s:.0f}s", lost=all_exited, interval_s=0.05,
                      shown=lambda p: p.role == "coordinator")

    def _wait_up(self, ready: Callable[[EtcdStore], Any], *, timeout_s: float, late: str,
                 lost: Callable[[list[ProcessRecord]], tuple[list[ProcessRecord], str]], interval_s: float,
                 shown: Callable[[ProcessRecord], bool] = lambda p: True) -> Any:
        """Poll ``ready`` until it answers (not None; a busy etcd is asked again). Fail, with the logs' tails, once
        ``lost`` finds among the exited processes the ones whose loss means it cannot come (and why), or at the
        deadline (``late``: why; the tails of the processes ``shown`` picks)."""
        deadline = time.monotonic() + timeout_s
        store = self.store()
        try:
            while True:
                try:
                    if (got := ready(store)) is not None:
                        return got
                except StoreError:
                    pass
                dead, why = lost(self.supervisor.exited())
                if dead or time.monotonic() > deadline:
                    tails = "\n".join(f"--- {p.name} ({p.log})\n{log_tail(p.log)}"
                                      for p in (dead or [p for p in self.processes if shown(p)]))
                    raise RallypointError(f"local cluster did not come up: {why if dead else late}\n{tails}")
                time.sleep(interval_s)
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
                    url = (parsed(kv, "leader") or {}).get("dashboard")
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
        """Record the cluster in its state dir (``cluster.json``)."""
        write_state(self.config, self.endpoints, self.processes, self.worker_networks)

    @classmethod
    def load(cls, state_dir: Path) -> LocalCluster:
        """The cluster recorded in ``state_dir``; ClusterNotFound if none is."""
        config, endpoints, processes, nets = read_state(state_dir)
        return cls(config, endpoints, processes, worker_networks=nets)

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
        return self.supervisor.find(name)

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to the recorded process ``name`` (only if it is still that process)."""
        self.supervisor.signal(name, sig)

    def reap(self, name: str, timeout_s: float = 5.0) -> None:
        self.supervisor.reap(name, timeout_s)

    def stop(self) -> None:
        """Stop every recorded process: the supervision first, then workers, coordinators, etcd, the zygote.
        Idempotent."""
        self._end_supervision()
        daemons = [p for p in self.processes if p.role == "supervisor"]
        for p in daemons:
            stop_process(p)
        if daemons and state_file(self.config.state_dir).exists():  # what the daemon restarted, it recorded
            self.supervisor.records = read_state(self.config.state_dir)[2]
        self.supervisor.stop_all()
        for p in self.processes:
            if p.role == "zygote":
                zygote.remove_socket(p.argv)
        if self.etcd is not None:
            self.etcd.stop()
        security.forget_client(self.endpoints)
        path = state_file(self.config.state_dir)
        if path.exists():
            path.unlink()
        self.log.info("cluster.stopped", processes=len(self.processes))

