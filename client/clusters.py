"""Finding a cluster from the command line: ``--state-dir`` or ``--cluster [NAME@]HOST:PORT[,...]``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from rallypoint.etcd.errors import ClusterNotFound
from rallypoint.etcd.keys import Keys, all_clusters_prefix, cluster_of, parse_cluster

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_STATE_DIR = ".rallypoint"


@dataclass(frozen=True)
class ClusterAddress:
    """Where a cluster's etcd is, and the cluster's name."""

    name: str
    endpoints: tuple[str, ...]


def resolve_cluster(state_dir: Path, cluster: str | None) -> ClusterAddress:
    """Find the cluster from ``--cluster`` or the state dir."""
    from rallypoint.cluster.local import LocalCluster
    from rallypoint.etcd.store import EtcdStore

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


def store_and_keys(state_dir: Path, cluster: str | None) -> tuple[Any, Keys]:
    from rallypoint.etcd.store import EtcdStore

    addr = resolve_cluster(state_dir, cluster)
    return EtcdStore(addr.endpoints), Keys(addr.name)
