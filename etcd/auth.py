"""etcd authentication for a cluster: one user per role, and one per worker, each with the least key ranges it needs.

:func:`enable_auth` does on a fresh etcd (TLS with ``--client-cert-auth``) what
``docs/security.md`` lists as etcdctl commands for a production etcd: a ``root`` user, then
for each role of :data:`GRANTS` an etcd role and a user ``BASE-ROLE`` (the common name of
that role's certificates, :func:`rallypoint.basics.authz.etcd_user`) with the permissions
listed there, then for each worker id it is given a user ``BASE-worker-ID`` with
:func:`worker_grants` (:func:`add_worker_user` adds one later, as ``root``), then ``auth
enable``. Key ranges are under the cluster's :attr:`~rallypoint.etcd.keys.Keys.prefix`:

===============  ============================================================================
coordinator      read-write on the whole prefix (it leads: jobs, leases, leader, lost, ...)
operator         read-write on the whole prefix (cordon, drain, repairs of a cluster's keys)
worker ID        read on the prefix; read-write on its own keys only: ``workers/ID`` (its
                 registration), ``devices/ID/``, ``cordon/ID`` and ``drain/ID`` (a preemption
                 notice) and ``commits/ID/`` (its checkpoint commits, which count once the
                 job's leader checked and promoted them to ``jobs/JOB/checkpoints/``)
worker           (a worker certificate without an id) read on the prefix; nothing written
client           read on the prefix; nothing written (it submits and watches through gRPC)
===============  ============================================================================

So a worker's certificate cannot write another worker's registration, devices, cordon or
drain, any device lease (``leases/`` are the leader's, on the leader's etcd lease, and the
leader deletes a lost worker's), any job record or commit (``jobs/`` is the coordinators'),
nor revoke another worker's etcd lease (etcd lets a revoke through only to a user who may
write every key on the lease, and a worker's lease carries only its own keys).
docs/security.md states what a worker's user may still do: read every key of the cluster,
and commit checkpoints of the slices its leader placed on it.

Rallypoint's processes never send a password: etcd takes the user from the common name
of their client certificate, so there is no auth token to expire and renew. The root
password is written (mode 0600) for an operator's ``etcdctl --user root`` and for
:func:`add_worker_user` (``rallypoint certs --etcd``), run by whoever administers etcd.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from rallypoint.basics.authz import CLIENT, COORDINATOR, OPERATOR, WORKER, etcd_user
from rallypoint.basics.errors import ConfigError, StoreError
from rallypoint.etcd.keys import Keys, check_name
from rallypoint.etcd.store import prefix_end
from rallypoint.basics.tls import ETCD_USER, TlsConfig
from rallypoint.basics.tls import channel as tls_channel

READ, READWRITE = auth_pb2.Permission.READ, auth_pb2.Permission.READWRITE
WHOLE = ""  # the cluster's prefix itself
KEY = "key"  # a grant of one key (``workers/ID``), not of every key it begins (``workers/ID0`` ...)
GRANTS: dict[str, tuple[tuple[int, str], ...]] = {
    # role: (permission, key prefix under the cluster's prefix), ...
    COORDINATOR: ((READWRITE, WHOLE),),
    OPERATOR: ((READWRITE, WHOLE),),
    WORKER: ((READ, WHOLE),),  # a worker certificate without an id writes nothing: worker_grants are per worker
    CLIENT: ((READ, WHOLE),),
}
ROOT_PASSWORD_FILE = "root.password"


def worker_grants(worker: str) -> tuple[tuple[int, str, str], ...]:
    """What worker ``worker``'s etcd user may do: (permission, key under the cluster's prefix, ``KEY`` for that one
    key or ``"prefix"`` for every key under it). Its own keys only (see the module doc)."""
    k = Keys("x")  # the schema's key names, relative to a cluster's prefix
    check_name("worker", worker)

    def rel(key: str) -> str:
        return key[len(k.prefix):]

    return ((READ, WHOLE, "prefix"), (READWRITE, rel(k.worker(worker)), KEY),
            (READWRITE, rel(k.worker_devices(worker)), "prefix"), (READWRITE, rel(k.cordon(worker)), KEY),
            (READWRITE, rel(k.drain(worker)), KEY), (READWRITE, rel(k.worker_commits(worker)), "prefix"))


def _role_steps(auth: etcdrpc.AuthStub, prefix: str, user: str,
                grants: Sequence[tuple[int, str, str]]) -> list[tuple[str, object, object]]:
    steps: list[tuple[str, object, object]] = [(f"role add {user}", auth.RoleAdd, etcdrpc.AuthRoleAddRequest(name=user))]
    for perm, sub, kind in grants:
        key = (prefix + sub).encode()
        end = b"" if kind == KEY else prefix_end(key)
        what = f"grant {'readwrite' if perm == READWRITE else 'read'} {prefix + sub}{'' if kind == KEY else '*'} to {user}"
        steps.append((what, auth.RoleGrantPermission, etcdrpc.AuthRoleGrantPermissionRequest(
            name=user, perm=auth_pb2.Permission(permType=perm, key=key, range_end=end))))
    # The password is never used (the certificate names the user); etcd 3.5.1's API has no --no-password.
    steps.append((f"user add {user}", auth.UserAdd,
                  etcdrpc.AuthUserAddRequest(name=user, password=secrets.token_urlsafe(24))))
    steps.append((f"grant {user}", auth.UserGrantRole, etcdrpc.AuthUserGrantRoleRequest(user=user, role=user)))
    return steps


def _steps(auth: etcdrpc.AuthStub, prefix: str, base: str, workers: Sequence[str]) -> list[tuple[str, object, object]]:
    steps: list[tuple[str, object, object]] = []
    for role, grants in GRANTS.items():
        steps += _role_steps(auth, prefix, etcd_user(base, role), [(p, k, "prefix") for p, k in grants])
    for w in dict.fromkeys(workers):
        steps += _role_steps(auth, prefix, etcd_user(base, WORKER, w), worker_grants(w))
    return steps


def add_worker_user(endpoints: Sequence[str], tls: TlsConfig, prefix: str, worker: str, *, root_password: str,
                    user: str = ETCD_USER, timeout_s: float = 10.0) -> str:
    """Add worker ``worker``'s etcd user ``USER-worker-ID`` (:func:`worker_grants`) to an etcd with auth on, as
    ``root`` (etcd's user administration needs it: no Rallypoint role may add users). Returns the user; a user
    that is already there is left as it is (its grants are the same)."""
    name = etcd_user(user, WORKER, check_name("worker", worker))
    ch = tls_channel(endpoints[0], tls, options=[("grpc.default_authority", endpoints[0])])
    auth = etcdrpc.AuthStub(ch)
    try:
        try:
            token = auth.Authenticate(etcdrpc.AuthenticateRequest(name="root", password=root_password),
                                      timeout=timeout_s).token
        except grpc.RpcError as exc:
            raise ConfigError(f"etcd refused root ({exc.code().name} {exc.details()}): give the root password "
                              f"`enable_auth` wrote ({ROOT_PASSWORD_FILE})") from None
        meta = (("token", token),)
        try:
            existing = auth.UserGet(etcdrpc.AuthUserGetRequest(name=name), timeout=timeout_s, metadata=meta)
            if name in existing.roles:
                return name
        except grpc.RpcError:
            pass  # no such user yet
        for what, call, request in _role_steps(auth, prefix, name, worker_grants(worker)):
            try:
                call(request, timeout=timeout_s, metadata=meta)  # type: ignore[operator]
            except grpc.RpcError as exc:
                if "already exists" in (exc.details() or ""):
                    continue  # a half-done earlier add: go on
                raise StoreError(f"adding etcd user {name} failed at `{what}`: {exc.code().name} "
                                 f"{exc.details()}") from None
    finally:
        ch.close()
    return name


def enable_auth(endpoints: Sequence[str], tls: TlsConfig, prefix: str, *, secrets_dir: Path,
                user: str = ETCD_USER, workers: Sequence[str] = (), timeout_s: float = 10.0) -> Path:
    """Create root, a user ``USER-ROLE`` per role of :data:`GRANTS` and ``USER-worker-ID`` per worker of ``workers``,
    turn auth on; returns the root password file."""
    ch = tls_channel(endpoints[0], tls, options=[("grpc.default_authority", endpoints[0])])
    auth = etcdrpc.AuthStub(ch)
    root_pw = secrets.token_urlsafe(24)
    steps = [
        ("user add root", auth.UserAdd, etcdrpc.AuthUserAddRequest(name="root", password=root_pw)),
        ("grant root", auth.UserGrantRole, etcdrpc.AuthUserGrantRoleRequest(user="root", role="root")),
        *_steps(auth, prefix, user, workers),
    ]
    secrets_dir.mkdir(parents=True, exist_ok=True)
    pw_file = secrets_dir / ROOT_PASSWORD_FILE
    fd = os.open(pw_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(root_pw + "\n")
    try:
        for what, call, request in steps:
            try:
                call(request, timeout=timeout_s)  # type: ignore[operator]
            except grpc.RpcError as exc:
                raise StoreError(f"etcd auth setup failed at `{what}`: {exc.code().name} {exc.details()}") from None
        try:
            auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise StoreError(f"etcd auth enable failed: {exc.code().name} {exc.details()}") from None
    finally:
        ch.close()
    return pw_file
