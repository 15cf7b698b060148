"""The daemon commands: ``python -m rallypoint.cluster.daemons worker|coordinator ...``.

The local cluster launcher (:mod:`rallypoint.cluster.local`) starts every process
with these; on real hosts a service manager does (``docs/operations.md``). Each
daemon stops cleanly on SIGINT; a worker takes SIGTERM as a preemption notice (it asks to
be drained, then leaves: :mod:`rallypoint.workers.preemption`), the others stop on it.
``supervise`` restarts the local cluster's coordinators and workers that die (what a
service manager does on real hosts).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from rallypoint.cluster.group import RallypointGroup
from rallypoint.basics.errors import ConfigError
from rallypoint.etcd.keys import parse_cluster
from rallypoint.basics.tls import TlsConfig
from rallypoint.basics.logs import configure as configure_logs
from rallypoint.workers.platform import PLATFORM_CHOICES

# Each command imports its own daemon: a coordinator never loads JAX and Orbax (a second of
# CPU at every start), a worker never loads the coordinator's modules.

F = TypeVar("F", bound=Callable[..., Any])


@click.group(cls=RallypointGroup)
def main() -> None:
    """Rallypoint's daemons (the local cluster and service managers start them)."""


def _daemon_options(f: F) -> F:
    f = click.option("--insecure", is_flag=True,
                     help="Plain TCP on every connection (gRPC, data plane, etcd): anyone who reaches a port can "
                     "act on the cluster. Only for a trusted network; see docs/security.md.")(f)
    f = click.option("--tls-dir", default="", metavar="DIR", envvar="RALLYPOINT_TLS_DIR",
                     help="Mutual TLS: DIR/ca.crt, DIR/<id>.crt and DIR/<id>.key (`rallypoint certs`).")(f)
    f = click.option("--lease-ttl-s", type=int, default=2, show_default=True)(f)
    f = click.option("--id", "ident", required=True, help="Stable id of this process.")(f)
    f = click.option("--cluster", "cluster", required=True, metavar="NAME@HOST:PORT[,...]")(f)
    return f


def tls_from_options(tls_dir: str, insecure: bool, ident: str, role: str) -> TlsConfig | None:
    """The daemon's identity from ``--tls-dir``/``--insecure``: one of the two is required, and the
    certificate must carry the daemon's ``role``."""
    if tls_dir and insecure:
        raise ConfigError("--tls-dir and --insecure exclude each other: pass one")
    if insecure:
        return None
    if not tls_dir:
        raise ConfigError(f"no TLS identity: pass --tls-dir DIR holding ca.crt, {ident}.crt and {ident}.key (make them "
                          f"with `rallypoint certs --out DIR --names {ident}`), or --insecure for plain TCP")
    tls = TlsConfig.from_dir(tls_dir, ident).check_role(role)
    return tls.check_worker(ident) if role == "worker" else tls


def _run_daemon(start: Callable[[], None], run: Callable[[], None], request_stop: Callable[[], None],
                stop: Callable[[], None], on_sigterm: Callable[[], None] | None = None) -> None:
    def handler(signum: int, _frame: Any) -> None:
        (on_sigterm or request_stop)() if signum == signal.SIGTERM else request_stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    start()
    try:
        run()
    finally:
        stop()


def _end_now() -> None:
    """End the process once its daemon stopped cleanly (its lease revoked, its record written, its jobs unloaded),
    skipping the interpreter's teardown: freeing XLA's client and gRPC's core took a worker 0.4-1 s of CPU after
    it had left, which every stop of a cluster waited for. Its logs are flushed first. (A daemon that fails ends
    the usual way, with its traceback; a command run in a test's own process is not ended.)"""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


@main.command()
@_daemon_options
@click.option("--devices", type=int, default=2, show_default=True,
              help="Local JAX devices (K): on a CPU host JAX is asked for K CPU devices; on a GPU or TPU host, the "
              "first K accelerators.")
@click.option("--platform", type=click.Choice(PLATFORM_CHOICES, case_sensitive=False), default=None,
              help="Pin JAX to this platform (default: what JAX finds). docs/platforms.md")
@click.option("--nondeterministic", is_flag=True,
              help="On GPU, do not turn on XLA's deterministic kernels (--xla_gpu_deterministic_ops=true): faster, "
              "but a replay may differ from the first run in its last bits (docs/platforms.md).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=0, help="gRPC port (0: a free one).")
@click.option("--register-timeout-s", type=float, default=30.0, show_default=True,
              help="How long to wait for an older incarnation of this id to expire.")
@click.option("--data-port", type=int, default=0, help="Data-plane port (0: a free one).")
@click.option("--advertise-address", default="", metavar="HOST:PORT",
              help="Where others reach the gRPC server, if not where it binds (e.g. behind a proxy).")
@click.option("--advertise-data-address", default="", metavar="HOST:PORT",
              help="Where others reach the data plane, if not where it binds.")
@click.option("--compile-cache-dir", default="", metavar="DIR",
              help="JAX's persistent compilation cache, shared by the workers of a host or cluster, so a reloaded "
              "slice does not compile again (empty: no cache; safe to delete).")
@click.option("--preempt-deadline-s", type=float, default=30.0, show_default=True,
              help="On SIGTERM (a preemption notice): how long the leader gets to drain this worker before it "
              "leaves anyway (0: SIGTERM stops at once, as SIGINT does).")
@click.option("--metrics-port", type=int, default=None,
              help="Serve Prometheus metrics on --host at this port (0: a free one; default: none). docs/metrics.md")
@click.option("--member-pool", type=click.IntRange(min=0), default=0, show_default=True,
              help="Multi-host slice member processes kept started ahead, JAX imported, so that a gang's group forms "
              "(and recovers) without waiting for them to load; each idle one holds its memory. docs/multihost.md")
@click.option("--source-hide", multiple=True, metavar="DIR",
              help="A folder host sources (submitted code) must not read, besides this worker's TLS folder; may be "
              "given again. docs/security.md")
@click.option("--source-write", multiple=True, metavar="DIR",
              help="A folder host sources may write, besides their own temporary folder, /dev/shm and the user's cache "
              "folder (~/.cache); may be given again. docs/security.md")
@click.option("--source-sandbox", type=click.Choice(("auto", "required", "off")), default="auto", show_default=True,
              help="Restrict host sources with Landlock where the kernel has it (auto), refuse to run them where it "
              "has not (required), or only scrub their environment (off). docs/security.md")
@click.option("--fault-commit-delay-s", type=float, default=0.0, hidden=True,
              help="Test fault: seconds each checkpoint commit waits after Orbax finalized it.")
@click.option("--fault-storage-flag", default="", hidden=True,
              help="Test fault: while this file exists, checkpoint saves fail with the errno named in it.")
@click.option("--fault-corrupt-replicas", is_flag=True, hidden=True,
              help="Test fault: every checkpoint copy this worker holds in memory gets one byte flipped.")
@click.option("--fault-corrupt-flag", default="", hidden=True,
              help="Test fault: the state updates named by the JSON specs in this file get one bit flipped.")
def worker(cluster: str, ident: str, lease_ttl_s: int, tls_dir: str, insecure: bool, devices: int, platform: str | None,
           nondeterministic: bool, host: str,
           port: int, register_timeout_s: float, data_port: int, advertise_address: str, advertise_data_address: str,
           compile_cache_dir: str, preempt_deadline_s: float, metrics_port: int | None, member_pool: int,
           source_hide: tuple[str, ...], source_write: tuple[str, ...], source_sandbox: str,
           fault_commit_delay_s: float, fault_storage_flag: str, fault_corrupt_replicas: bool,
           fault_corrupt_flag: str) -> None:
    """Run the worker daemon (one per accelerator host)."""
    configure_logs()
    from rallypoint.workers.config import WorkerConfig
    from rallypoint.workers.daemon import WorkerDaemon
    from rallypoint.workers.faults import WorkerFaults

    name, endpoints = parse_cluster(cluster)
    tls = tls_from_options(tls_dir, insecure, ident, "worker")
    cfg = WorkerConfig(tls=tls, cluster=name or "local", worker_id=ident, endpoints=endpoints, devices=devices,
                       platform=platform or "", deterministic=not nondeterministic, lease_ttl_s=lease_ttl_s, host=host,
                       port=port, register_timeout_s=register_timeout_s,
                       data_port=data_port, advertise_address=advertise_address,
                       advertise_data_address=advertise_data_address, compile_cache_dir=compile_cache_dir,
                       preempt_deadline_s=preempt_deadline_s, metrics_port=metrics_port, member_pool=member_pool,
                       source_hide=tuple(source_hide), source_write=tuple(source_write), source_sandbox=source_sandbox,
                       faults=WorkerFaults(commit_delay_s=fault_commit_delay_s, storage_flag=fault_storage_flag,
                                          corrupt_replicas=fault_corrupt_replicas, corrupt_flag=fault_corrupt_flag))
    d = WorkerDaemon(cfg)
    _run_daemon(d.start, d.run, d.request_stop, d.stop, on_sigterm=d.request_preemption)


@main.command()
@_daemon_options
@click.option("--checkpoint-dir", default=None, help="Where jobs keep checkpoints unless they name a directory (shared "
              "by every worker). Default: STATE_DIR/checkpoints (RALLYPOINT_STATE_DIR, default .rallypoint); empty: "
              "none, and jobs with states are refused.")
@click.option("--keep-runs", type=click.IntRange(min=0), default=0, show_default=True,
              help="When a new run of a job name starts (--new-run), keep this many of its earlier runs and delete "
              "older ones (0: keep all; `rallypoint delete-run` deletes one by hand).")
@click.option("--keep-history-s", type=click.FloatRange(min=0), default=7 * 86400.0, show_default=True,
              help="How long an ended run (succeeded, failed, cancelled, or an earlier run) stays listed by "
              "`rallypoint jobs`; then the leader removes its record and commits from etcd, its files stay "
              "(0: keep for ever).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Where the coordinator's gRPC service listens.")
@click.option("--suspect-after-s", type=float, default=1.0, show_default=True,
              help="The leader fences a worker whose heartbeats stopped this long (hung or cut off), well before its "
                   "lease TTL; 0: only the TTL finds it.")
@click.option("--metrics-port", type=int, default=None,
              help="Serve Prometheus metrics on --host at this port (0: a free one; default: none). docs/metrics.md")
@click.option("--dashboard-host", default="127.0.0.1", show_default=True,
              help="Where the dashboard's HTTP server listens (docs/dashboard.md; plain HTTP: keep it on loopback "
                   "or behind an authenticating proxy).")
@click.option("--dashboard-port", type=click.IntRange(min=-1, max=65535), default=0, show_default=True,
              help="The dashboard's port (0: a free one, -1: no dashboard). Its address is logged "
                   "(dashboard.serving) and published in the leader key.")
@click.option("--max-watchers", type=click.IntRange(min=1), default=128, show_default=True,
              help="WatchJob streams this coordinator serves at once; one more is refused with RESOURCE_EXHAUSTED "
                   "(docs/control-plane.md).")
@click.option("--test-skip-replay", is_flag=True, hidden=True,
              help="Fault hook for tests: recoveries skip the replay (the chaos suite proves its checks catch it).")
@click.option("--test-finish-gate", default="", hidden=True,
              help="Fault hook for tests: a job entering FINISHING writes JOB.finishing in this directory and fetches "
                   "its final state once JOB.go is there.")
def coordinator(cluster: str, ident: str, lease_ttl_s: int, tls_dir: str, insecure: bool, checkpoint_dir: str | None,
                keep_runs: int, keep_history_s: float, host: str, suspect_after_s: float, metrics_port: int | None,
                dashboard_host: str,
                dashboard_port: int, max_watchers: int, test_skip_replay: bool, test_finish_gate: str) -> None:
    """Run a coordinator (several run; one leads)."""
    from rallypoint.orchestrator.service.coordinator import Coordinator, CoordinatorConfig
    from rallypoint.orchestrator.service.dashboard import start_dashboard
    from rallypoint.orchestrator.job.hooks import ExecutorHooks
    from rallypoint.orchestrator.service.jobs import serve_jobs

    configure_logs()
    if checkpoint_dir is None:  # under the state directory, as `rallypoint up` gives its coordinators
        checkpoint_dir = str((Path(os.environ.get("RALLYPOINT_STATE_DIR") or ".rallypoint") / "checkpoints").absolute())
    name, endpoints = parse_cluster(cluster)
    hooks = ExecutorHooks(skip_replay=test_skip_replay, finish_gate=test_finish_gate)
    tls = tls_from_options(tls_dir, insecure, ident, "coordinator")
    c = Coordinator(CoordinatorConfig(tls=tls, cluster=name or "local", coordinator_id=ident, endpoints=endpoints,
                                      lease_ttl_s=lease_ttl_s, checkpoint_dir=checkpoint_dir, keep_runs=keep_runs,
                                      keep_history_s=keep_history_s, host=host, hooks=hooks,
                                      suspect_after_s=suspect_after_s, metrics_port=metrics_port,
                                      max_watchers=max_watchers))
    service = serve_jobs(c)
    dashboard = start_dashboard(c, service, host=dashboard_host, port=dashboard_port) if dashboard_port >= 0 else None
    done = threading.Event()

    def stopped() -> None:
        done.set()
        if dashboard is not None:
            dashboard.stop()

    _run_daemon(lambda: None, c.run, c.stop, stopped)


@main.command()
@click.option("--state-dir", required=True, type=click.Path(file_okay=False, exists=True),
              help="The local cluster's state dir (its cluster.json names the processes to supervise).")
def supervise(state_dir: str) -> None:
    """Restart the local cluster's coordinators and workers that die, with backoff (`rallypoint up` starts it)."""
    from pathlib import Path

    from rallypoint.cluster.local import LocalCluster

    configure_logs()
    lc = LocalCluster.load(Path(state_dir))
    stop = threading.Event()
    _run_daemon(lambda: None, lambda: lc.run_supervision(stop), stop.set, lambda: None)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as done:
        if done.code in (None, 0):
            _end_now()
        raise
