"""Finding a cluster from the command line: ``--state-dir`` or ``--cluster [NAME@]HOST:PORT[,...]``.

And the identity to reach it with: a cluster of ``--state-dir`` brings its own (its
``tls/client.crt``); with ``--cluster``, ``--tls-dir DIR`` (``DIR/ca.crt``,
``DIR/client.crt``, ``DIR/client.key``) or an explicit ``--insecure``. The identity is
recorded for the cluster's etcd endpoints (:func:`rallypoint.basics.tls.remember`), so every
connection of this process to that cluster (etcd, the coordinators) uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from rallypoint.basics import tls as tls_registry
from rallypoint.basics.errors import ClusterNotFound, ConfigError, StoreError
from rallypoint.etcd.keys import Keys, all_clusters_prefix, cluster_of, parse_cluster

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_STATE_DIR = ".rallypoint"
CLIENT_CERT = "client"


def _keep(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    ctx.meta[f"rallypoint.{param.name}"] = value
    return value


def tls_options(f: F) -> F:
    """``--tls-dir`` and ``--insecure``; read back with :func:`insecure` and :func:`client_tls`."""
    f = click.option("--insecure", is_flag=True, expose_value=False, callback=_keep,
                     help="Plain TCP to a --cluster started with --insecure; for an embedded cluster: start it "
                     "without TLS and etcd auth (docs/security.md).")(f)
    f = click.option("--tls-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                     envvar="RALLYPOINT_TLS_DIR", expose_value=False, callback=_keep,
                     help="With --cluster: the cluster's certificates (ca.crt, client.crt, client.key; "
                     "`rallypoint certs`, or STATE_DIR/tls of `rallypoint up`).")(f)
    return f


def insecure() -> bool:
    """Whether ``--insecure`` was given to the running command."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.meta.get("rallypoint.insecure"))


def client_tls() -> tls_registry.TlsConfig | None:
    """The identity for ``--cluster``: ``--tls-dir``, or None for ``--insecure``; one is required."""
    ctx = click.get_current_context(silent=True)
    tls_dir = ctx.meta.get("rallypoint.tls_dir") if ctx is not None else None
    if tls_dir and insecure():
        raise ConfigError("--tls-dir and --insecure exclude each other: pass one")
    if insecure():
        return None
    if not tls_dir:
        raise ConfigError("--cluster needs the cluster's certificates: pass --tls-dir DIR (ca.crt, client.crt, "
                          "client.key; for a `rallypoint up` cluster STATE_DIR/tls), or --insecure for a cluster "
                          "started with --insecure")
    return tls_registry.TlsConfig.from_dir(tls_dir, CLIENT_CERT)


@dataclass(frozen=True)
class ClusterAddress:
    """Where a cluster's etcd is, and the cluster's name."""

    name: str
    endpoints: tuple[str, ...]


def resolve_cluster(state_dir: Path, cluster: str | None) -> ClusterAddress:
    """Find the cluster from ``--cluster`` or the state dir."""
    from rallypoint.cluster.local import LocalCluster
    from rallypoint.etcd.etcd_store import CLIENT_CONNECT_WAIT_S, EtcdStore

    if cluster:
        name, endpoints = parse_cluster(cluster)
        tls_registry.remember(endpoints, client_tls())
        if name is None:
            store = EtcdStore(endpoints, connect_wait_s=CLIENT_CONNECT_WAIT_S)
            try:
                kvs, _ = store.get_prefix(all_clusters_prefix())
            except StoreError as exc:
                if "PERMISSION_DENIED" not in str(exc):
                    raise
                raise ClusterNotFound(f"etcd at {','.join(endpoints)} lets this client see only its own cluster's "
                                      "keys (etcd auth): name the cluster with --cluster NAME@HOST:PORT") from None
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
    f = tls_options(f)
    f = click.option(
        "--state-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_STATE_DIR,
        envvar="RALLYPOINT_STATE_DIR", show_default=True, help="Where `rallypoint up` records its cluster.",
    )(f)
    return f


def store_and_keys(state_dir: Path, cluster: str | None) -> tuple[Any, Keys]:
    from rallypoint.etcd.etcd_store import CLIENT_CONNECT_WAIT_S, EtcdStore

    addr = resolve_cluster(state_dir, cluster)
    return EtcdStore(addr.endpoints, connect_wait_s=CLIENT_CONNECT_WAIT_S), Keys(addr.name)


def export_platforms_for(given: str | None, *, reference: bool, cluster: str | None) -> tuple[str, ...] | None:
    """What `rallypoint run` exports a job for (docs/platforms.md): ``given`` (``--platform P[,P...]``), else the
    platforms of the pool's live workers (``--cluster``; none yet: this process's), else cpu (the embedded
    cluster's workers); None (this process's platform) for ``--reference``."""
    if given:
        return tuple(p for p in given.split(",") if p.strip())
    if reference:
        return None
    if not cluster:
        return ("cpu",)  # the embedded cluster's workers run K CPU devices, whatever this host has
    from rallypoint.etcd.cluster_view import read_cluster
    from rallypoint.recovery.platforms import pool_platforms

    store, keys = store_and_keys(Path(DEFAULT_STATE_DIR), cluster)
    try:
        offered = pool_platforms(read_cluster(store, keys))
    finally:
        store.close()
    return tuple(sorted(offered)) or None  # no worker yet: this process's platform
