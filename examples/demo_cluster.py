"""`make demo`: the embedded local cluster at work.

Starts etcd, two coordinators and three workers (two for jobs, one spare) as real
processes, leases a virtual slice to a job, kills the worker holding it with
SIGKILL and shows the loss being detected and its devices freed, hangs another
with SIGSTOP and shows lease expiry, then stops everything it started.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from rallypoint.client.commands.main import worker_rows  # noqa: E402
from rallypoint.etcd.cluster_view import read_cluster  # noqa: E402
from rallypoint.orchestrator.control.devices import DeviceLeases  # noqa: E402
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig  # noqa: E402
from rallypoint.basics.logs import configure  # noqa: E402

console = Console(width=110)


def show(lc: LocalCluster, title: str) -> None:
    store = lc.store()
    try:
        snap = read_cluster(store, lc.keys)
        leader = store.get(lc.keys.leader)
    finally:
        store.close()
    lead = f"{leader.json()['coordinator']} (term {leader.create_revision})" if leader else "none"
    table = Table(title=f"{title} — leader {lead}")
    for col in ("worker", "pid", "incarnation", "state", "devices", "leased to"):
        table.add_column(col)
    for r in worker_rows(snap):
        table.add_row(r["worker"], str(r["pid"]), str(r["incarnation"]), r["state"], str(r["devices"]),
                      ", ".join(r["leased_to"]) or "-")
    console.print(table)


def wait_lost(lc: LocalCluster, worker: str, since: float) -> tuple[float, str]:
    store = lc.store()
    try:
        while time.monotonic() - since < 30:
            kv = store.get(lc.keys.lost(worker))
            if kv is not None:
                return time.monotonic() - since, kv.json()["reason"]
            time.sleep(0.01)
    finally:
        store.close()
    raise SystemExit(f"{worker} was not detected as lost within 30 s")


def main() -> None:
    configure(level="warning")
    state = Path(__file__).resolve().parents[1] / ".rallypoint" / "demo"
    ttl = 2
    console.print(f"[bold]Starting a local cluster[/] in {state} (etcd, 2 coordinators, 2 workers + 1 spare, "
                  f"2 CPU devices each, lease TTL {ttl}s)")
    lc = LocalCluster.start(LocalClusterConfig(state_dir=state, workers=2, spares=1, devices_per_worker=2,
                                               coordinators=2, lease_ttl_s=ttl))
    try:
        show(lc, "cluster up")
        store = lc.store()
        try:
            p = DeviceLeases(store, lc.keys).allocate("demo-job", "stage0", 2)
        finally:
            store.close()
        console.print(f"leased slice demo-job/stage0 -> {p.worker} devices {list(p.devices)} "
                      f"(compare-and-swap at revision {p.revision})")
        show(lc, "one slice leased, the rest spare")
        time.sleep(0.5)

        console.print(f"[bold red]SIGKILL[/] {p.worker} (pid {lc.process(p.worker).pid})")
        t0 = time.monotonic()
        lc.signal(p.worker, signal.SIGKILL)
        took, reason = wait_lost(lc, p.worker, t0)
        console.print(f"  detected in {took * 1000:.0f} ms via {reason}; its lease revoked, devices freed")

        hung = next(w for w in ("w0", "w1", "w2") if w != p.worker)
        console.print(f"[bold yellow]SIGSTOP[/] {hung} (a hang: its socket stays open)")
        t0 = time.monotonic()
        lc.signal(hung, signal.SIGSTOP)
        took, reason = wait_lost(lc, hung, t0)
        console.print(f"  detected in {took:.2f} s via {reason} (TTL {ttl}s)")
        lc.signal(hung, signal.SIGCONT)
        time.sleep(1.0)
        console.print(f"[bold]SIGCONT[/] {hung}: it fenced itself and registered as a new incarnation")
        show(lc, "after the faults")
    finally:
        lc.stop()
        console.print(f"stopped every process the demo started (logs kept in {state / 'logs'})")


if __name__ == "__main__":
    main()
