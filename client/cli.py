"""The ``rallypoint`` command line.

Every operator command finds its cluster through ``--state-dir DIR`` (default
``.rallypoint/``, or ``RALLYPOINT_STATE_DIR``), where ``rallypoint up`` recorded
it, or through ``--cluster [NAME@]HOST:PORT[,HOST:PORT...]`` (etcd endpoints).
Errors print one clear line and exit non-zero; a rejected command changes nothing.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from orchestrator.errors import ClusterNotFound, ConfigError, RallypointError
from orchestrator.keys import Keys, all_clusters_prefix, check_name, cluster_of
from orchestrator.logs import configure as configure_logs

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_STATE_DIR = ".rallypoint"


@dataclass(frozen=True)
class ClusterAddress:
    """Where a cluster's etcd is, and the cluster's name."""

    name: str
    endpoints: tuple[str, ...]


def parse_cluster(addr: str) -> tuple[str | None, tuple[str, ...]]:
    """Parse ``[NAME@]HOST:PORT[,HOST:PORT...]``."""
    name, _, rest = addr.rpartition("@")
    endpoints = tuple(e.strip() for e in rest.split(",") if e.strip())
    if not endpoints:
        raise ConfigError(f"--cluster {addr!r}: give etcd endpoints as [NAME@]HOST:PORT[,HOST:PORT...]")
    for ep in endpoints:
        host, _, port = ep.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--cluster {addr!r}: {ep!r} is not HOST:PORT (e.g. 127.0.0.1:2379)")
    if name:
        check_name("cluster", name)
    return name or None, endpoints


def resolve_cluster(state_dir: Path, cluster: str | None) -> ClusterAddress:
    """Find the cluster from ``--cluster`` or the state dir."""
    from orchestrator.local_cluster import LocalCluster
    from orchestrator.store import EtcdStore

    if cluster:
        name, endpoints = parse_cluster(cluster)
        if name is None:
            store = EtcdStore(endpoints)
            try:
                kvs, _ = store.get_prefix(all_clusters_prefix())
            finally:
                store.close()
            names = sorted({cluster_of(kv.key) for kv in kvs})
            if len(names) != 1:
                raise ClusterNotFound(
                    f"etcd at {','.join(endpoints)} holds clusters {names or 'none'}; "
                    "name one with --cluster NAME@HOST:PORT"
                )
            name = names[0]
        return ClusterAddress(name, endpoints)
    lc = LocalCluster.load(state_dir)
    return ClusterAddress(lc.config.cluster, tuple(lc.endpoints))


def cluster_options(f: F) -> F:
    f = click.option(
        "--cluster", "cluster", default=None, metavar="[NAME@]HOST:PORT[,...]",
        help="etcd endpoints of the cluster (instead of --state-dir).",
    )(f)
    f = click.option(
        "--state-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_STATE_DIR,
        envvar="RALLYPOINT_STATE_DIR", show_default=True, help="Where `rallypoint up` records its cluster.",
    )(f)
    return f


class RallypointGroup(click.Group):
    """Turns every RallypointError into one clear line and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except RallypointError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)


@click.group(cls=RallypointGroup)
def main() -> None:
    """Rallypoint: a fault-tolerant training orchestrator for JAX."""


# -- local cluster -----------------------------------------------------------------------


@main.command()
@click.option("--workers", type=int, default=2, show_default=True, help="Workers for job slices.")
@click.option("--spares", type=int, default=1, show_default=True, help="Extra workers kept free for recovery.")
@click.option("--devices-per-worker", type=int, default=2, show_default=True, help="JAX CPU devices per worker.")
@click.option("--coordinators", type=int, default=2, show_default=True, help="Coordinator processes (one leads).")
@click.option("--etcd-members", type=click.Choice(["1", "3"]), default="1", show_default=True)
@click.option("--lease-ttl-s", type=int, default=2, show_default=True, help="Worker and leader lease TTL.")
@click.option("--name", "cluster_name", default="local", show_default=True, help="Cluster name.")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_STATE_DIR,
              envvar="RALLYPOINT_STATE_DIR", show_default=True)
def up(workers: int, spares: int, devices_per_worker: int, coordinators: int, etcd_members: str,
       lease_ttl_s: int, cluster_name: str, state_dir: Path) -> None:
    """Start a local cluster in the background (etcd, coordinators, workers)."""
    from orchestrator.local_cluster import LocalCluster, LocalClusterConfig

    config = LocalClusterConfig(
        state_dir=state_dir.resolve(), workers=workers, spares=spares, devices_per_worker=devices_per_worker,
        coordinators=coordinators, etcd_members=int(etcd_members), lease_ttl_s=lease_ttl_s, cluster=cluster_name,
    )
    configure_logs(level="warning")
    lc = LocalCluster.start(config)
    n = workers + spares
    click.echo(f"cluster {config.cluster!r} is up: etcd {','.join(lc.endpoints)}, "
               f"{coordinators} coordinators, {n} workers x {devices_per_worker} devices")
    click.echo(f"  state dir: {config.state_dir}  (logs in {config.state_dir / 'logs'})")
    click.echo(f"  reach it:  rallypoint workers --state-dir {state_dir}")
    click.echo(f"        or:  rallypoint workers --cluster {config.cluster}@{','.join(lc.endpoints)}")
    click.echo(f"  stop it:   rallypoint down --state-dir {state_dir}")


@main.command()
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_STATE_DIR,
              envvar="RALLYPOINT_STATE_DIR", show_default=True)
def down(state_dir: Path) -> None:
    """Stop exactly the processes `rallypoint up` started."""
    from orchestrator.local_cluster import LocalCluster, is_running

    configure_logs(level="warning")
    lc = LocalCluster.load(state_dir)
    running = [p for p in lc.processes if is_running(p)]
    lc.stop()
    click.echo(f"cluster {lc.config.cluster!r} stopped ({len(running)} processes)")


# -- operator commands ---------------------------------------------------------------------


def _store_and_keys(state_dir: Path, cluster: str | None) -> tuple[Any, Keys]:
    from orchestrator.store import EtcdStore

    addr = resolve_cluster(state_dir, cluster)
    return EtcdStore(addr.endpoints), Keys(addr.name)


def worker_rows(snapshot: Any) -> list[dict[str, Any]]:
    """One row per worker (live or lost) for `rallypoint workers`."""
    rows = []
    for w, s in sorted(snapshot.workers.items()):
        holders = sorted({f"{h.job}/{h.slice}" for h in s.holders.values()})
        rows.append({
            "worker": w, "pid": s.info.pid, "incarnation": s.info.incarnation, "state": s.state, "alive": True,
            "devices": len(s.devices), "free": len(s.free), "leased_to": holders, "address": s.info.address,
        })
    for w, rec in sorted(snapshot.lost.items()):
        if w not in snapshot.workers:
            rows.append({
                "worker": w, "pid": rec.get("pid", 0), "incarnation": rec.get("incarnation", 0), "state": "lost",
                "alive": False, "devices": 0, "free": 0, "leased_to": [], "address": rec.get("address", ""),
                "lost_reason": rec.get("reason", ""),
            })
    return rows


@main.command()
@cluster_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def workers(state_dir: Path, cluster: str | None, as_json: bool) -> None:
    """List workers: id, pid, incarnation, state, devices, lease holders."""
    from orchestrator.devices import read_cluster

    store, keys = _store_and_keys(state_dir, cluster)
    try:
        snap = read_cluster(store, keys)
        leader = store.get(keys.leader)
    finally:
        store.close()
    rows = worker_rows(snap)
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    from rich.console import Console
    from rich.table import Table

    lead = f"{leader.json()['coordinator']} (term {leader.create_revision})" if leader else "none"
    table = Table(title=f"cluster {keys.cluster}: {len(snap.workers)} live workers, leader {lead}")
    for col in ("worker", "pid", "incarnation", "state", "devices", "free", "leased to"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["worker"], str(r["pid"]), str(r["incarnation"]), r["state"], str(r["devices"]),
                      str(r["free"]), ", ".join(r["leased_to"]) or "-")
    Console(width=120).print(table)


@main.command()
@cluster_options
@click.argument("worker")
def cordon(state_dir: Path, cluster: str | None, worker: str) -> None:
    """Stop new device leases on WORKER (its current leases stay)."""
    from orchestrator.devices import DeviceLeases

    store, keys = _store_and_keys(state_dir, cluster)
    try:
        DeviceLeases(store, keys).cordon(worker)
    finally:
        store.close()
    click.echo(f"worker {worker} cordoned")


@main.command()
@cluster_options
@click.argument("worker")
def uncordon(state_dir: Path, cluster: str | None, worker: str) -> None:
    """Allow new device leases on WORKER again."""
    from orchestrator.devices import DeviceLeases

    store, keys = _store_and_keys(state_dir, cluster)
    try:
        was = DeviceLeases(store, keys).uncordon(worker)
    finally:
        store.close()
    click.echo(f"worker {worker} uncordoned" if was else f"worker {worker} was not cordoned")


@main.command()
@cluster_options
@click.argument("job")
@click.option("--slice", "slice_name", default=None, help="Only this virtual slice of the job.")
def release(state_dir: Path, cluster: str | None, job: str, slice_name: str | None) -> None:
    """Release the device leases held by JOB (or one of its slices)."""
    from orchestrator.devices import DeviceLeases

    check_name("job", job)
    store, keys = _store_and_keys(state_dir, cluster)
    try:
        n = DeviceLeases(store, keys).release(job, slice_name)
    finally:
        store.close()
    click.echo(f"released {n} devices of {job}{'/' + slice_name if slice_name else ''}")


# -- running jobs ---------------------------------------------------------------------------

HOST_DEVICES = 8  # JAX CPU devices of the client process (set before the job file runs JAX)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--steps", type=int, default=None, help="Override the program's step count.")
@click.option("--reference", is_flag=True, help="Run in this process, no cluster: the bitwise reference.")
@click.option("--cluster", "cluster", default=None, metavar="[NAME@]HOST:PORT[,...]",
              help="Run on this cluster (etcd endpoints) instead of an embedded one.")
@click.option("--workers", type=int, default=None, help="Embedded cluster: workers (default: one per slice).")
@click.option("--spares", type=int, default=1, show_default=True, help="Embedded cluster: spare workers.")
@click.option("--devices-per-worker", type=int, default=None,
              help="Embedded cluster: devices per worker (default: the largest slice).")
@click.option("--window", type=int, default=2, show_default=True, help="Steps in flight.")
@click.option("--json", "as_json", is_flag=True, help="One JSON event per line instead of a progress bar.")
def run(job_file: Path, steps: int | None, reference: bool, cluster: str | None, workers: int | None, spares: int,
        devices_per_worker: int | None, window: int, as_json: bool) -> None:
    """Run the program built by JOB_FILE: on an embedded local cluster (default), on --cluster, or --reference."""
    from client.compile import compile_program, ensure_host_devices

    ensure_host_devices(HOST_DEVICES)
    from client.jobfile import load_program
    from client.reference import ReferenceExecutor

    program = load_program(job_file, steps=steps)
    if reference and (cluster or workers is not None or devices_per_worker is not None):
        raise ConfigError("--reference runs in this process: it takes no --cluster, --workers or --devices-per-worker")
    compiled = compile_program(program)
    where = "reference"
    if reference:
        def runner(on_step: Callable[[int, dict[str, float]], None]) -> Any:
            return ReferenceExecutor(compiled, on_step=on_step).run()
    else:
        where = "cluster" if cluster else "embedded cluster"

        def runner(on_step: Callable[[int, dict[str, float]], None]) -> Any:
            return _run_on_cluster(compiled, cluster, workers, spares, devices_per_worker, window, on_step, as_json)

    if as_json:
        def on_step(step: int, metrics: dict[str, float]) -> None:
            click.echo(json.dumps({"event": "step", "job": program.name, "step": step, "metrics": metrics}))

        result = runner(on_step)
        click.echo(json.dumps(result.finished_event()))
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[metrics]}"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn()) as bar:
        task = bar.add_task(f"{program.name} ({where})", total=program.steps, metrics="", rate="")

        first: list[float] = []

        def show(step: int, metrics: dict[str, float]) -> None:
            now = time.perf_counter()
            if not first:
                first.append(now)
            rate = f"{step / (now - first[0]):.1f} steps/s" if step and now > first[0] else ""  # from step 0's end
            bar.update(task, advance=1, metrics=" ".join(f"{k} {v:.4f}" for k, v in metrics.items()), rate=rate)

        result = runner(show)
    click.echo(f"{program.name}: {result.steps} steps in {result.wall_s:.2f}s, state digest {result.state_digest}")


def _run_on_cluster(compiled: Any, cluster: str | None, workers: int | None, spares: int,
                    devices_per_worker: int | None, window: int,
                    on_step: Callable[[int, dict[str, float]], None], quiet: bool) -> Any:
    """Submit to ``--cluster``, or start an embedded local cluster for the run and stop it after."""
    import tempfile

    from client.submit import submit
    from orchestrator.local_cluster import LocalCluster, LocalClusterConfig

    program = compiled.program
    if cluster:
        addr = resolve_cluster(Path(DEFAULT_STATE_DIR), cluster)
        return submit(compiled, endpoints=addr.endpoints, cluster=addr.name, window=window, on_step=on_step)
    n_workers = workers if workers is not None else len(program.slices)
    k = devices_per_worker if devices_per_worker is not None else max(s.devices for s in program.slices.values())
    program.validate_for_cluster(workers=n_workers, devices_per_worker=k)
    configure_logs(level="warning")
    state = Path(tempfile.mkdtemp(prefix=f"rallypoint-{program.name}-"))
    if not quiet:
        click.echo(f"starting an embedded cluster: {n_workers} workers + {spares} spares x {k} devices ({state})")
    lc = LocalCluster.start(LocalClusterConfig(state_dir=state, workers=n_workers, spares=spares,
                                               devices_per_worker=k, coordinators=2))
    ok = False
    try:
        result = submit(compiled, endpoints=lc.endpoints, cluster=lc.config.cluster, window=window, on_step=on_step)
        ok = True
        return result
    finally:
        lc.stop()
        if ok:
            import shutil

            shutil.rmtree(state, ignore_errors=True)
        else:
            click.echo(f"the embedded cluster's logs are in {state / 'logs'}", err=True)


# -- daemons ------------------------------------------------------------------------------


def _daemon_options(f: F) -> F:
    f = click.option("--lease-ttl-s", type=int, default=2, show_default=True)(f)
    f = click.option("--id", "ident", required=True, help="Stable id of this process.")(f)
    f = click.option("--cluster", "cluster", required=True, metavar="NAME@HOST:PORT[,...]")(f)
    return f


def _run_daemon(start: Callable[[], None], run: Callable[[], None], request_stop: Callable[[], None],
                stop: Callable[[], None]) -> None:
    def handler(signum: int, _frame: Any) -> None:
        request_stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    start()
    try:
        run()
    finally:
        stop()


@main.command(hidden=False)
@_daemon_options
@click.option("--devices", type=int, default=2, show_default=True, help="Local JAX devices (K).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=0, help="gRPC port (0: a free one).")
@click.option("--register-timeout-s", type=float, default=30.0, show_default=True,
              help="How long to wait for an older incarnation of this id to expire.")
def worker(cluster: str, ident: str, lease_ttl_s: int, devices: int, host: str, port: int,
           register_timeout_s: float) -> None:
    """Run the worker daemon (one per accelerator host)."""
    from workers.daemon import WorkerConfig, WorkerDaemon

    configure_logs()
    name, endpoints = parse_cluster(cluster)
    cfg = WorkerConfig(cluster=name or "local", worker_id=ident, endpoints=endpoints, devices=devices,
                       lease_ttl_s=lease_ttl_s, host=host, port=port, register_timeout_s=register_timeout_s)
    d = WorkerDaemon(cfg)
    _run_daemon(d.start, d.run, d.request_stop, d.stop)


@main.command()
@_daemon_options
@click.option("--checkpoint-dir", default="", help="Where jobs keep checkpoints unless they name a directory "
              "(shared by every worker; empty: such jobs run without checkpoints).")
def coordinator(cluster: str, ident: str, lease_ttl_s: int, checkpoint_dir: str) -> None:
    """Run a coordinator (several run; one leads)."""
    from orchestrator.coordinator import Coordinator, CoordinatorConfig

    configure_logs()
    name, endpoints = parse_cluster(cluster)
    c = Coordinator(CoordinatorConfig(cluster=name or "local", coordinator_id=ident, endpoints=endpoints,
                                      lease_ttl_s=lease_ttl_s, checkpoint_dir=checkpoint_dir))
    done = threading.Event()
    _run_daemon(lambda: None, c.run, c.stop, done.set)


if __name__ == "__main__":
    main()
