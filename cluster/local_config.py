"""The shape of a local cluster: its configuration and where each worker sits on the network.

:class:`LocalClusterConfig` is what ``rallypoint up`` and tests ask for (checked when made);
:class:`WorkerNetwork` is one worker's placement, returned per worker by a
:data:`WorkerNetworkHook` (``chaos/network.py`` provides the ``netns`` and ``proxy`` ones).
The launcher that starts a cluster of this shape is :mod:`rallypoint.cluster.local`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rallypoint.basics.errors import ConfigError
from rallypoint.etcd.keys import check_name
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from rallypoint.workers.faults import NO_FAULTS, WorkerFaults
from rallypoint.workers.platform import PLATFORM_CHOICES, check_platform

NETWORKS = ("loopback", "netns", "proxy")
DEFAULT_HOST = "127.0.0.1"


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
            ``--test-*`` options, :class:`rallypoint.orchestrator.job.hooks.ExecutorHooks`); none by default.
        tls: mutual TLS everywhere and etcd auth (the default); False runs every process
            ``--insecure`` (plain TCP, etcd without auth): ``rallypoint up --insecure``.
        metrics: every coordinator and worker serves Prometheus metrics on a free port
            (``--metrics-port 0``); each publishes the address in its etcd record, where
            :meth:`~rallypoint.cluster.local.LocalCluster.metrics_targets` and ``rallypoint metrics``
            find it (docs/metrics.md).
        supervise: coordinators and workers that die are started again, with backoff and
            a restart limit (:class:`~rallypoint.cluster.processes.RestartPolicy`), as a
            service manager would on real hosts: by a thread of the process that started
            the cluster, or by a ``supervise`` daemon after ``rallypoint up`` (which turns
            it on). Off by default here: a test or chaos scenario that kills a process
            expects it to stay dead unless it asks for supervision.
        member_pool: gang member processes each worker keeps started ahead (``--member-pool``),
            so that a multi-host slice's group forms faster (docs/multihost.md); 0: none.
        checkpoint_dir: the coordinators' checkpoint root (``--checkpoint-dir``); None puts it at
            ``<state_dir>/checkpoints`` (kept across ``down`` and ``up``). The embedded ``rallypoint run``
            gives ``<RALLYPOINT_STATE_DIR>/runs``, so its runs outlive its cluster.
        platform: the workers' JAX platform (``--platform``: cpu, cuda, rocm, tpu, gpu); on a GPU
            host the workers split its devices (:mod:`rallypoint.cluster.local_devices`).
        host_devices: the host's devices of ``platform`` (asked once, by ``rallypoint up`` or ``run``,
            through :func:`~rallypoint.cluster.local_devices.host_device_count`); 0 on cpu.
        zygote: fork the workers from one process that has imported JAX and their modules
            (:mod:`rallypoint.cluster.zygote`): a worker up in a fraction of its start's CPU. On cpu with
            the loopback network only; elsewhere, or off, each worker is a fresh process.
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
    supervise: bool = False
    member_pool: int = 0
    checkpoint_dir: Path | None = None
    platform: str = "cpu"
    host_devices: int = 0
    zygote: bool = True

    def __post_init__(self) -> None:
        check_name("cluster", self.cluster)
        if not check_platform(self.platform):
            raise ConfigError(f"--platform must name a platform ({', '.join(PLATFORM_CHOICES)}), got {self.platform!r}")
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
        if self.member_pool < 0:
            raise ConfigError(f"--member-pool must be 0 (none) or more, got {self.member_pool}")
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
