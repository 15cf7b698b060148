"""The ``rallypoint`` command line.

Every operator command finds its cluster through ``--state-dir DIR`` (default
``.rallypoint/``, or ``RALLYPOINT_STATE_DIR``), where ``rallypoint up`` recorded
it, or through ``--cluster [NAME@]HOST:PORT[,HOST:PORT...]`` (etcd endpoints).
Errors print one clear line and exit non-zero; a rejected command changes nothing.
"""

from __future__ import annotations

import errno
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from rallypoint.etcd.records import parsed
from rallypoint.client.commands import export as export_cli
from rallypoint.client.commands import jobs as jobs_cli

from rallypoint.client.commands import lifecycle as lifecycle_cli

from rallypoint.client.commands import plot as plot_cli

from rallypoint.client.commands import run as run_cli
from rallypoint.client.commands.clusters import DEFAULT_STATE_DIR, cluster_options, store_and_keys
from rallypoint.basics.errors import ConfigError
from rallypoint.etcd.keys import check_name
from rallypoint.cluster.group import RallypointGroup
from rallypoint.basics.logs import configure as configure_logs

F = TypeVar("F", bound=Callable[..., Any])

_WHAT_TO_DO = {
    errno.EACCES: "give a path this user may write (or read), or fix its permissions",
    errno.EPERM: "give a path this user may write (or read), or fix its permissions",
    errno.ENOENT: "check the path: it (or a folder above it) does not exist",
    errno.ENOTDIR: "a part of the path is a file, not a folder: give another path",
    errno.EEXIST: "something is in the way at that path: move it or give another path",
    errno.EISDIR: "the path is a folder where a file was expected: give a file",
    errno.ENOSPC: "the disk is full: free space or give a path on another disk",
    errno.EROFS: "the file system is read-only: give a writable path",
}


def os_error_message(exc: OSError) -> str:
    """One line for an operating-system error: what failed, on which path, and what to do."""
    what = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is None:  # no path: a socket, a pipe, a process
        return f"{what} ({type(exc).__name__}); check that what the command reaches is up, then run it again"
    where = str(exc.filename) + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
    hint = _WHAT_TO_DO.get(exc.errno or 0, "check the path and its permissions, then run the command again")
    return f"cannot use {where}: {what}; {hint}"


class CliGroup(RallypointGroup):
    """The ``rallypoint`` group: besides RallypointError (one line, exit 1), an operating-system
    error of any verb (a folder it cannot make, a file it cannot read) is one line naming the
    path and what to do, exit 1, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OSError as exc:
            click.echo(f"error: {os_error_message(exc)}", err=True)
            sys.exit(1)


@click.group(cls=CliGroup)
def main() -> None:
    """Rallypoint: a fault-tolerant training orchestrator for JAX."""


# -- local cluster -----------------------------------------------------------------------


@main.command()
@click.option("--workers", type=int, default=2, show_default=True, help="Workers for job slices.")
@click.option("--spares", type=int, default=1, show_default=True, help="Extra workers kept free for recovery.")
@click.option("--devices-per-worker", type=click.IntRange(min=1), default=None,
              help="Devices per worker (default: 2 on cpu; on a GPU host its devices split among the workers).")
@click.option("--platform", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda", "rocm", "tpu", "gpu"]),
              help="The workers' JAX platform: cpu makes K CPU devices per worker; on cuda or rocm the workers take "
              "the host's GPUs (docs/platforms.md).")
@click.option("--coordinators", type=int, default=2, show_default=True, help="Coordinator processes (one leads).")
@click.option("--etcd-members", type=click.Choice(["1", "3"]), default="1", show_default=True)
@click.option("--lease-ttl-s", type=int, default=2, show_default=True, help="Worker and leader lease TTL.")
@click.option("--name", "cluster_name", default="local", show_default=True, help="Cluster name.")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_STATE_DIR,
              envvar="RALLYPOINT_STATE_DIR", show_default=True)
@click.option("--insecure", is_flag=True, help="No TLS and no etcd auth: plain TCP everywhere (docs/security.md).")
@click.option("--no-supervise", is_flag=True, help="Do not restart coordinators and workers that die (by default a "
              "supervise daemon restarts them with backoff, as systemd or Kubernetes would; docs/operations.md).")
def up(workers: int, spares: int, devices_per_worker: int | None, platform: str, coordinators: int, etcd_members: str,
       lease_ttl_s: int, cluster_name: str, state_dir: Path, insecure: bool, no_supervise: bool) -> None:
    """Start a local cluster in the background (etcd, coordinators, workers)."""
    from rallypoint.cluster.local import LocalCluster, LocalClusterConfig
    from rallypoint.cluster.local_devices import local_plan

    plan, host_devices = local_plan(platform, processes=workers + spares, devices_per_worker=devices_per_worker)
    devices_per_worker = plan.devices_per_worker
    config = LocalClusterConfig(
        state_dir=state_dir.resolve(), workers=workers, spares=spares, devices_per_worker=devices_per_worker,
        coordinators=coordinators, etcd_members=int(etcd_members), lease_ttl_s=lease_ttl_s, cluster=cluster_name,
        tls=not insecure, supervise=not no_supervise, platform=plan.platform, host_devices=host_devices,
    )
    configure_logs(level="warning")
    lc = LocalCluster.start(config)
    lc.detach_supervision()  # the supervise daemon outlives this command
    n = workers + spares
    click.echo(f"cluster {config.cluster!r} is up: etcd {','.join(lc.endpoints)}, "
               f"{coordinators} coordinators, {n} workers x {plan.describe()}")
    click.echo(f"  state dir: {config.state_dir}  (logs in {config.state_dir / 'logs'})")
    dashboard = lc.leader_dashboard()
    click.echo(f"  dashboard: {dashboard}  (the leader's live view; docs/dashboard.md)" if dashboard
               else "  dashboard: none published yet (see the coordinators' logs: dashboard.serving)")
    click.echo(f"  reach it:  rallypoint workers --state-dir {state_dir}")
    tls = f"--tls-dir {lc.tls_dir}" if config.tls else "--insecure"
    click.echo(f"        or:  rallypoint workers --cluster {config.cluster}@{','.join(lc.endpoints)} {tls}")
    click.echo(f"  stop it:   rallypoint down --state-dir {state_dir}")
    targets = lc.metrics_targets()
    deadline = time.monotonic() + 5.0  # coordinators record themselves as they first campaign
    while sum(t["role"] == "coordinator" for t in targets) < coordinators and time.monotonic() < deadline:
        time.sleep(0.2)
        targets = lc.metrics_targets()
    click.echo("  metrics:   " + (", ".join(f"{t['name']} http://{t['address']}/metrics" for t in targets) or "none")
               + f"  (rallypoint metrics --state-dir {state_dir})")


@main.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory for ca.crt/ca.key and NAME.crt/NAME.key (made if missing; an existing CA is kept).")
@click.option("--names", default="etcd,c0,c1,w0,w1,w2,client", show_default=True, metavar="NAME[:ROLE][,...]",
              help="One certificate per process: the ids given to --id, plus `client` for the CLI and `etcd`. Each "
              "carries a role (client, operator, coordinator, worker, etcd): cN is a coordinator, wN a worker, a "
              "role's own name that role; any other name needs :ROLE (docs/security.md).")
@click.option("--hosts", default="127.0.0.1,localhost", show_default=True, metavar="HOST[,HOST...]",
              help="IPs and DNS names every certificate is valid for (where the processes are reached).")
@click.option("--user", default="rallypoint", show_default=True,
              help="Base of the etcd users the certificates act as: USER-ROLE (their common name; etcd "
              "--client-cert-auth).")
@click.option("--cluster", "cluster_name", default="local", show_default=True,
              help="Cluster name (in the CA's name; with --etcd, the cluster whose keys its users are confined to).")
@click.option("--days", default=90, show_default=True, type=click.IntRange(min=1),
              help="How long the certificates are good for. Nothing revokes one: make them again before they end "
              "(the servers load the new files for new connections, docs/security.md).")
@click.option("--etcd", "etcd_endpoints", default=None, metavar="HOST:PORT[,...]",
              help="Also add each worker's own etcd user (USER-worker-ID, its own keys only) to this etcd, as root.")
@click.option("--root-password-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --etcd: the file holding etcd's root password.")
def certs(out: Path, names: str, hosts: str, user: str, cluster_name: str, days: int, etcd_endpoints: str | None,
          root_password_file: Path | None) -> None:
    """Make a CA and per-process certificates for mutual TLS (docs/security.md)."""
    from rallypoint.cluster.certs import make_certs

    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if not wanted:
        raise ConfigError("--names is empty: name at least one process")
    if etcd_endpoints and root_password_file is None:
        raise ConfigError("--etcd needs --root-password-file: adding an etcd user takes etcd's root")
    made = make_certs(out, wanted, hosts=[h.strip() for h in hosts.split(",") if h.strip()], user=user,
                      cluster=cluster_name, days=days)
    click.echo(f"CA: {out / 'ca.crt'} (its key {out / 'ca.key'} signs new certificates: keep it private)")
    for name, tls in made.items():
        click.echo(f"  {name} (role {tls.role()}, {days} days): {tls.cert} {tls.key}")
    if etcd_endpoints:
        _add_worker_users(out, made, etcd_endpoints, root_password_file, user=user, cluster=cluster_name)
    click.echo(f"daemons: --tls-dir {out} (each loads ca.crt and <id>.crt/<id>.key); CLI: --tls-dir {out}")


def _add_worker_users(out: Path, made: dict[str, Any], endpoints: str, password_file: Path | None, *, user: str,
                      cluster: str) -> None:
    """Each new worker certificate's etcd user, added as root (the others' users are the same for every cluster)."""
    from rallypoint.basics.authz import WORKER
    from rallypoint.etcd.auth import add_worker_user
    from rallypoint.etcd.keys import Keys, parse_cluster

    assert password_file is not None
    try:
        password = password_file.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"--root-password-file {password_file} cannot be read ({exc.strerror}): give the file "
                          "holding etcd's root password") from None
    _name, eps = parse_cluster(endpoints)
    via = next((t for n, t in made.items() if t.role() != "etcd"), None)
    if via is None and (out / "client.crt").exists():
        from rallypoint.basics.tls import TlsConfig

        via = TlsConfig.from_dir(out, "client")
    if via is None:
        raise ConfigError(f"--etcd: no client certificate in {out} to reach etcd with; make one (--names client)")
    for name, tls in made.items():
        if tls.role() == WORKER:
            added = add_worker_user(eps, via, Keys(cluster).prefix, name, root_password=password, user=user)
            click.echo(f"  etcd user {added}: worker {name}'s own keys under {Keys(cluster).prefix}")


@main.command()
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_STATE_DIR,
              envvar="RALLYPOINT_STATE_DIR", show_default=True)
def down(state_dir: Path) -> None:
    """Stop exactly the processes `rallypoint up` started."""
    from rallypoint.cluster.local import LocalCluster, is_running

    configure_logs(level="warning")
    lc = LocalCluster.load(state_dir)
    running = [p for p in lc.processes if is_running(p)]
    lc.stop()
    click.echo(f"cluster {lc.config.cluster!r} stopped ({len(running)} processes)")


# -- operator commands ---------------------------------------------------------------------


def worker_rows(snapshot: Any) -> list[dict[str, Any]]:
    """One row per worker (live or lost) for `rallypoint workers`."""
    rows = []
    for w, s in sorted(snapshot.workers.items()):
        holders = sorted({f"{h.job}/{h.slice}" for h in s.holders.values()})
        rows.append({
            "worker": w, "pid": s.info.pid, "incarnation": s.info.incarnation, "state": s.state, "alive": True,
            "devices": len(s.devices), "free": len(s.free), "leased_to": holders, "address": s.info.address,
            "platform": s.info.platform, "device_kind": s.info.device_kind,
            "device_memory_bytes": s.info.device_memory_bytes, "deterministic": s.info.deterministic,
            **({"cordoned_by": s.cordoned_by} if s.cordoned else {}),
        })
    for w, rec in sorted(snapshot.lost.items()):
        if w not in snapshot.workers:
            rows.append({
                "worker": w, "pid": rec.get("pid", 0), "incarnation": rec.get("incarnation", 0), "state": "lost",
                "alive": False, "devices": 0, "free": 0, "leased_to": [], "address": rec.get("address", ""),
                "lost_reason": rec.get("reason", ""), "platform": "", "device_kind": "", "device_memory_bytes": 0,
                "deterministic": True,
            })
    return rows


def device_cell(row: dict[str, Any]) -> str:
    """The devices column of `rallypoint workers`: platform, kind and memory of each device.

    ``cpu x2 (host memory)``, ``cuda x8 NVIDIA H100 80GB HBM3, 79.1 GiB each``; a GPU without
    deterministic kernels is marked ``nondeterministic`` (docs/platforms.md)."""
    if not row["alive"]:
        return "-"
    platform = row.get("platform") or "?"
    kind = row.get("device_kind") or ""
    text = f"{platform} x{row['devices']}"
    if kind and kind.lower() != platform:
        text += f" {kind}"
    mem = int(row.get("device_memory_bytes") or 0)
    text += f", {mem / 2**30:.1f} GiB each" if mem else " (host memory)"
    if not row.get("deterministic", True):
        text += ", nondeterministic"
    return text


@main.command()
@cluster_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def workers(state_dir: Path, cluster: str | None, as_json: bool) -> None:
    """List workers: id, pid, incarnation, state, devices (platform, kind, memory), lease holders."""
    from rallypoint.etcd.cluster_view import read_cluster

    store, keys = store_and_keys(state_dir, cluster)
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

    rec = parsed(leader, "leader")
    lead = f"{rec.get('coordinator')} (term {leader.create_revision})" if leader and rec is not None else "none"
    if rec is not None and rec.get("dashboard"):
        lead += f", dashboard {rec['dashboard']}"
    table = Table(title=f"cluster {keys.cluster}: {len(snap.workers)} live workers, leader {lead}")
    for col in ("worker", "pid", "incarnation", "state", "devices", "free", "leased to"):
        table.add_column(col)
    for r in rows:
        state = f"{r['state']} ({r['cordoned_by']})" if r.get("cordoned_by") else r["state"]
        table.add_row(r["worker"], str(r["pid"]), str(r["incarnation"]), state, device_cell(r),
                      str(r["free"]), ", ".join(r["leased_to"]) or "-")
    Console(width=160).print(table)


@main.command()
@cluster_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def metrics(state_dir: Path, cluster: str | None, as_json: bool) -> None:
    """List the Prometheus endpoints of the live coordinators and workers (docs/metrics.md)."""
    from rallypoint.etcd.metrics_targets import read_metrics_targets

    store, keys = store_and_keys(state_dir, cluster)
    try:
        rows = read_metrics_targets(store, keys)
    finally:
        store.close()
    for r in rows:
        url = f"http://{r['address']}/metrics"
        if as_json:
            click.echo(json.dumps({**r, "url": url}))
        else:
            click.echo(f"{r['role']:<12} {r['name']:<12} {url}{'  (leader)' if r['leader'] else ''}")
    if not rows and not as_json:
        click.echo("no process serves metrics (start the daemons with --metrics-port)")


@main.command()
@cluster_options
@click.argument("worker")
def cordon(state_dir: Path, cluster: str | None, worker: str) -> None:
    """Stop new device leases on WORKER (its current leases stay)."""
    from rallypoint.orchestrator import api

    store, keys = store_and_keys(state_dir, cluster)
    try:
        api.cordon(store, keys, worker)
    finally:
        store.close()
    click.echo(f"worker {worker} cordoned")


@main.command()
@cluster_options
@click.argument("worker")
def uncordon(state_dir: Path, cluster: str | None, worker: str) -> None:
    """Allow new device leases on WORKER again."""
    from rallypoint.orchestrator import api

    store, keys = store_and_keys(state_dir, cluster)
    try:
        was = api.uncordon(store, keys, worker)
        store.delete(keys.drain(worker))  # a drain still pending stops with it
    finally:
        store.close()
    click.echo(f"worker {worker} uncordoned" if was else f"worker {worker} was not cordoned")


@main.command()
@cluster_options
@click.argument("worker")
@click.option("--deadline-s", type=float, default=300.0, show_default=True,
              help="How long to wait for every job to move its slices off WORKER.")
@click.option("--json", "as_json", is_flag=True, help="The outcome as one JSON object.")
def drain(state_dir: Path, cluster: str | None, worker: str, deadline_s: float, as_json: bool) -> None:
    """Move every slice on WORKER to spare devices with no lost work; WORKER ends cordoned.

    Each slice saves its state at the next step boundary (a checkpoint off the
    schedule), a spare restores it, the other workers are rewired: nothing re-runs.
    Refused, with nothing changed, when some slice finds no spare.
    """
    import getpass

    from rallypoint.client.commands.drains import begin_drain, end_drain, held_slices, wait_drained

    if deadline_s <= 0:
        raise click.BadParameter(f"must be > 0 seconds, got {deadline_s:g}", param_hint="--deadline-s")
    store, keys = store_and_keys(state_dir, cluster)
    try:
        jobs = frozenset(js.split("/")[0] for js in held_slices(store, keys, worker))
        req, cordoned_now = begin_drain(store, keys, worker, by=f"operator {getpass.getuser()}", deadline_s=deadline_s)
        if not as_json:
            click.echo(f"draining worker {worker} (cordoned; waiting up to {deadline_s:g}s)")
        outcome = wait_drained(store, keys, req, timeout_s=deadline_s, jobs=jobs)
        end_drain(store, keys, req, outcome, cordoned_now=cordoned_now)
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps({"worker": worker, **outcome.to_json()}))
    else:
        for job, r in sorted(outcome.results.items()):
            rec = r.record
            if r.state == "done":
                click.echo(f"  {job}: moved {rec.get('moved')} at step {rec.get('step')}, paused "
                           f"{rec.get('paused_s')}s, replayed 0 instances")
            else:
                click.echo(f"  {job}: cancelled: {r.reason}")
    if outcome.state == "done":
        if not as_json:
            click.echo(f"worker {worker} drained: it holds no device lease and stays cordoned "
                       f"(`rallypoint uncordon {worker}` to use it again)")
        return
    if outcome.state == "cancelled":
        raise click.ClickException(f"drain of worker {worker} cancelled; "
                                   + "; ".join(r.reason for r in outcome.results.values() if r.state == "cancelled")
                                   + (" (its cordon was taken back)" if cordoned_now else ""))
    raise click.ClickException(f"worker {worker} still holds {outcome.held} after {deadline_s:g}s; it stays cordoned "
                               "and the request was withdrawn: run `rallypoint drain` again, or see "
                               "`rallypoint status JOB`")


@main.command()
@cluster_options
@click.argument("job")
@click.option("--slice", "slice_name", default=None, help="Only this virtual slice of the job.")
def release(state_dir: Path, cluster: str | None, job: str, slice_name: str | None) -> None:
    """Release the device leases held by JOB (or one of its slices)."""
    from rallypoint.orchestrator import api

    check_name("job", job)
    store, keys = store_and_keys(state_dir, cluster)
    try:
        n = api.release(store, keys, job, slice_name)
    finally:
        store.close()
    click.echo(f"released {n} devices of {job}{'/' + slice_name if slice_name else ''}")


main.add_command(run_cli.run)
main.add_command(jobs_cli.status)
main.add_command(jobs_cli.jobs)
main.add_command(jobs_cli.resume)
main.add_command(jobs_cli.delete_run)
main.add_command(lifecycle_cli.watch)
main.add_command(lifecycle_cli.cancel)
main.add_command(lifecycle_cli.suspend)
main.add_command(lifecycle_cli.logs)
main.add_command(plot_cli.plot)
main.add_command(export_cli.export)
