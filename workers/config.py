"""The settings of a worker daemon (:class:`WorkerConfig`): its cluster, devices, addresses,
lease, caches and identity, checked when made. ``rallypoint worker`` builds one from its
options (:mod:`rallypoint.cluster.daemons`); :class:`~rallypoint.workers.daemon.WorkerDaemon`
serves with it."""

from __future__ import annotations

from dataclasses import dataclass

from rallypoint.basics.errors import ConfigError
from rallypoint.basics.tls import TlsConfig
from rallypoint.etcd.keys import check_name
from rallypoint.workers.faults import NO_FAULTS, WorkerFaults
from rallypoint.workers.platform import check_platform

__all__ = ["WorkerConfig"]


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Settings of one worker daemon.

    Attributes:
        cluster: cluster name (key prefix in etcd).
        worker_id: stable id of this host's worker.
        endpoints: etcd client endpoints ``host:port``.
        devices: number of local devices K (on a CPU host, JAX is asked for K CPU devices; on an
            accelerator host, the first K of the accelerators JAX finds).
        platform: pin JAX to this platform (``cpu``, ``cuda``, ``rocm``, ``tpu``, ``gpu``); "" uses
            what JAX finds (docs/platforms.md).
        deterministic: on GPU, append ``--xla_gpu_deterministic_ops=true`` to ``XLA_FLAGS`` before
            JAX starts (bitwise recovery rests on it; docs/platforms.md). False leaves XLA_FLAGS as
            the operator set it; the registration says whether the kernels are deterministic.
        lease_ttl_s: etcd lease TTL; a hung worker is declared lost about this long
            after its last keepalive. etcd raises values below its minimum.
        host: address the gRPC server and the data plane bind (and advertise, unless
            overridden below).
        port: gRPC port (0 picks a free one).
        data_port: data-plane port (0 picks a free one).
        advertise_address: ``host:port`` others reach the gRPC server at, when that is
            not where it binds (e.g. behind a proxy); "" advertises the bound address.
        advertise_data_address: the same for the data plane.
        register_timeout_s: how long to wait for an older incarnation's lease to
            expire before giving up on registration.
        discover_devices: list devices through JAX (True) or only count them.
        compile_cache_dir: JAX's persistent compilation cache (shared by the workers of
            a host or of the cluster), so a reloaded slice does not compile its programs
            again; "" compiles every program afresh (docs/runtime.md).
        preempt_deadline_s: how long a preemption notice (SIGTERM) gives the leader to
            drain this worker before it leaves anyway (:mod:`rallypoint.workers.preemption`).
        faults: test fault hooks (:mod:`rallypoint.workers.faults`); none in production.
        tls: this worker's certificate, key and CA: mutual TLS on its gRPC server, its data
            plane, its pushes to peers and its etcd connection (None: plain, ``--insecure``).
        metrics_port: serve Prometheus metrics on ``host`` at this port (0: a free one; None: no
            endpoint). The address is logged (``metrics.serving``) and is ``metrics_address`` in
            the worker's etcd record (docs/metrics.md).
        member_pool: gang member processes kept started ahead, with JAX imported, so that a
            multi-host slice's group forms without waiting for them to load (0: none; each idle
            one holds its memory: :class:`rallypoint.workers.gang.link.MemberPool`).
        source_hide: folders host sources must not read, besides the worker's TLS folder (``--source-hide``;
            :mod:`rallypoint.workers.sources.sandbox`).
        source_write: folders host sources may write besides their own temporary folder and the user's cache
            folder (``--source-write``).
        source_sandbox: ``auto``, ``required`` or ``off`` (``--source-sandbox``, the same module).
    """

    cluster: str
    worker_id: str
    endpoints: tuple[str, ...]
    devices: int = 2
    platform: str = ""
    deterministic: bool = True
    lease_ttl_s: int = 2
    host: str = "127.0.0.1"
    port: int = 0
    data_port: int = 0
    advertise_address: str = ""
    advertise_data_address: str = ""
    register_timeout_s: float = 30.0
    discover_devices: bool = True
    compile_cache_dir: str = ""
    preempt_deadline_s: float = 30.0
    faults: WorkerFaults = NO_FAULTS
    tls: TlsConfig | None = None
    metrics_port: int | None = None
    member_pool: int = 0
    source_hide: tuple[str, ...] = ()
    source_write: tuple[str, ...] = ()
    source_sandbox: str = "auto"

    def __post_init__(self) -> None:
        check_name("worker", self.worker_id)
        if self.devices < 1:
            raise ConfigError(f"a worker needs at least 1 device, got devices={self.devices}")
        if self.lease_ttl_s < 1:
            raise ConfigError(f"lease_ttl_s must be >= 1, got {self.lease_ttl_s}")
        if not self.endpoints:
            raise ConfigError("no etcd endpoints: pass --cluster HOST:PORT")
        object.__setattr__(self, "platform", check_platform(self.platform))
