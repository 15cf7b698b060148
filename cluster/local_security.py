"""The local cluster's security set-up: certificates for its processes and etcd's users.

A local cluster with ``tls`` on (the default; ``docs/security.md``) keeps a CA in
``<state-dir>/tls`` (:mod:`rallypoint.cluster.certs`) and gives every process its own
certificate with its role (coordinator or worker), made afresh at each start of the
process and naming the addresses it binds and advertises, in a folder of its own,
``<state-dir>/tls/<name>/`` (``ca.crt`` and its own pair only): a daemon is never pointed at
``ca.key`` or another role's key, and workers hide ``<state-dir>/tls`` and etcd's secrets from
the job code they run (``--source-hide``, :mod:`rallypoint.workers.sources.sandbox`). etcd gets the ``etcd``
certificate, runs with client-certificate auth, and has a user per role that may only
touch what that role needs of this cluster's prefix (:func:`rallypoint.etcd.auth.enable_auth`),
and a user per worker, confined to that worker's own keys, added as ``root`` (with the root
password kept in ``<state-dir>/etcd``) when the worker's certificate is made
(:func:`add_worker`).
Clients (the CLI, tests) use the ``client`` certificate, which in-process clients find by
the cluster's endpoints (:func:`rallypoint.basics.tls.remember`). Its role is operator:
whoever starts an embedded cluster administers it (cordon, drain) as well as submitting.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from rallypoint.basics import tls as tls_registry
from rallypoint.basics.authz import ETCD, OPERATOR
from rallypoint.basics.tls import CA_FILE, TlsConfig
from rallypoint.cluster.certs import DEFAULT_HOSTS, issue
from rallypoint.cluster.local_config import WorkerNetwork
from rallypoint.etcd.auth import ROOT_PASSWORD_FILE, add_worker_user, enable_auth
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.server import EtcdCluster

TLS_DIR = "tls"
CLIENT_CERT = "client"  # the identity the CLI and in-process clients use (role operator)
ETCD_CERT = "etcd"


def cluster_tls_dir(state_dir: Path) -> Path:
    """The cluster's CA and per-process certificates."""
    return (state_dir / TLS_DIR).absolute()


def client_tls(tls_dir: Path) -> TlsConfig:
    """The identity clients of the cluster use (ConfigError when its files are missing)."""
    return TlsConfig.from_dir(tls_dir, CLIENT_CERT)


def remember_client(endpoints: Sequence[str], tls_dir: Path | None) -> None:
    """Let in-process clients of ``endpoints`` (``EtcdStore(endpoints)``, submit) find the client identity
    (``tls_dir`` None: an ``--insecure`` cluster, recorded as plain)."""
    tls_registry.remember(endpoints, None if tls_dir is None else TlsConfig(
        tls_dir / "ca.crt", tls_dir / f"{CLIENT_CERT}.crt", tls_dir / f"{CLIENT_CERT}.key"))


def forget_client(endpoints: Sequence[str]) -> None:
    """Undo :func:`remember_client` (a stopped cluster's endpoints may be reused)."""
    tls_registry.forget(endpoints)


def issue_etcd_and_client(state_dir: Path, *, host: str, cluster: str) -> tuple[TlsConfig, TlsConfig]:
    """The certificates of etcd and of the cluster's clients, naming ``host`` and the loopback names."""
    tls_dir = state_dir / TLS_DIR
    hosts = list(dict.fromkeys([host, *DEFAULT_HOSTS]))
    etcd_tls = issue(tls_dir, ETCD_CERT, role=ETCD, hosts=hosts, cluster=cluster)
    client = issue(tls_dir, CLIENT_CERT, role=OPERATOR, hosts=hosts, cluster=cluster)
    return etcd_tls, client


def enable_etcd_auth(etcd: EtcdCluster, client: TlsConfig, *, cluster: str, secrets_dir: Path,
                     workers: Sequence[str] = ()) -> None:
    """etcd's users (root, one per role on the cluster's prefix only, and one per worker of ``workers``: made now,
    before any process uses etcd, since each change of etcd's users fails the requests in flight with "auth:
    revision in header is old"), then auth on; stops etcd on failure."""
    try:
        enable_auth(etcd.endpoints, client, Keys(cluster).prefix, secrets_dir=secrets_dir, workers=workers)
    except BaseException:
        etcd.stop()
        raise


def process_tls_dir(tls_dir: Path, name: str) -> Path:
    """The folder process ``name`` is pointed at (``--tls-dir``): ``ca.crt`` and its own certificate and key only."""
    return tls_dir / name


def add_worker(endpoints: Sequence[str], tls_dir: Path, secrets_dir: Path, *, cluster: str, worker: str) -> None:
    """Worker ``worker``'s etcd user (its own keys only), added as root if it is not there yet."""
    password = (secrets_dir / ROOT_PASSWORD_FILE).read_text().strip()
    add_worker_user(endpoints, client_tls(tls_dir), Keys(cluster).prefix, worker, root_password=password)


def issue_process(tls_dir: Path, name: str, *, role: str, host: str, cluster: str, net: WorkerNetwork | None) -> Path:
    """A fresh certificate of ``role`` for process ``name``, naming every address it binds or is reached at, in a
    folder of its own (:func:`process_tls_dir`, mode 0700): never beside ``ca.key`` or another process's key."""
    hosts = [host, *DEFAULT_HOSTS]
    if net is not None:
        advertised = (net.advertise_address, net.advertise_data_address)
        hosts += [net.host] + [a.rpartition(":")[0] for a in advertised if a]
    issue(tls_dir, name, role=role, hosts=list(dict.fromkeys(hosts)), cluster=cluster)
    own = process_tls_dir(tls_dir, name)
    own.mkdir(mode=0o700, exist_ok=True)
    os.chmod(own, 0o700)
    shutil.copyfile(tls_dir / CA_FILE, own / f".{CA_FILE}.tmp")
    os.replace(own / f".{CA_FILE}.tmp", own / CA_FILE)
    for suffix in (".crt", ".key"):  # moved, not copied: the CA's folder keeps no process's key
        os.replace(tls_dir / f"{name}{suffix}", own / f"{name}{suffix}")
    return own
