"""etcd authentication for a cluster: one user per role, each with the least key ranges it needs.

:func:`enable_auth` does on a fresh etcd (TLS with ``--client-cert-auth``) what
``docs/security.md`` lists as etcdctl commands for a production etcd: a ``root`` user, then
for each role of :data:`GRANTS` an etcd role and a user ``BASE-ROLE`` (the common name of
that role's certificates, :func:`rallypoint.basics.authz.etcd_user`) with the permissions
listed there, then ``auth enable``. Key ranges are under the cluster's
:attr:`~rallypoint.etcd.keys.Keys.prefix`:

=============  ==============================================================================
coordinator    read-write on the whole prefix (it leads: jobs, leases, leader, lost, ...)
operator       read-write on the whole prefix (cordon, drain, repairs of a cluster's keys)
worker         read on the prefix; read-write on ``workers/``, ``devices/`` (its registration),
               ``leases/`` (the device leases on its etcd lease), ``cordon/``, ``drain/`` (a
               preemption notice) and ``jobs/`` (checkpoint commits)
client         read on the prefix; nothing written (it submits and watches through gRPC)
=============  ==============================================================================

etcd's RBAC grants key ranges only, with no wildcard inside a key and no per-user key: so
a worker's user may write every worker's registration (not only its own); commits
``jobs/JOB/checkpoints/...`` share the range of the job records ``jobs/JOB``, so the worker
user may also write job records; and since etcd lets a put with a lease (and a lease's
revoke) through only to a user who may write every key attached to the lease, and the
leader attaches a worker's device leases to that worker's etcd lease, the worker user may
write ``leases/`` too. docs/security.md states these limits.

Rallypoint's processes never send a password: etcd takes the user from the common name
of their client certificate, so there is no auth token to expire and renew. The root
password is written (mode 0600) for an operator's ``etcdctl --user root``; nothing in
Rallypoint reads it.
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
from rallypoint.basics.errors import StoreError
from rallypoint.etcd.store import prefix_end
from rallypoint.basics.tls import ETCD_USER, TlsConfig
from rallypoint.basics.tls import channel as tls_channel

READ, READWRITE = auth_pb2.Permission.READ, auth_pb2.Permission.READWRITE
WHOLE = ""  # the cluster's prefix itself
GRANTS: dict[str, tuple[tuple[int, str], ...]] = {
    # role: (permission, key prefix under the cluster's prefix), ...
    COORDINATOR: ((READWRITE, WHOLE),),
    OPERATOR: ((READWRITE, WHOLE),),
    # leases/: the leader attaches a worker's device leases to that worker's etcd lease, and etcd lets
    # a put with a lease (and a revoke) through only to a user who may write every key on the lease.
    WORKER: ((READ, WHOLE), (READWRITE, "workers/"), (READWRITE, "devices/"), (READWRITE, "leases/"),
             (READWRITE, "cordon/"), (READWRITE, "drain/"), (READWRITE, "jobs/")),
    CLIENT: ((READ, WHOLE),),
}
ROOT_PASSWORD_FILE = "root.password"


def _steps(auth: etcdrpc.AuthStub, prefix: str, base: str) -> list[tuple[str, object, object]]:
    steps: list[tuple[str, object, object]] = []
    for role, grants in GRANTS.items():
        user = etcd_user(base, role)
        steps.append((f"role add {user}", auth.RoleAdd, etcdrpc.AuthRoleAddRequest(name=user)))
        for perm, sub in grants:
            key = (prefix + sub).encode()
            what = f"grant {'readwrite' if perm == READWRITE else 'read'} {prefix + sub} to {user}"
            steps.append((what, auth.RoleGrantPermission, etcdrpc.AuthRoleGrantPermissionRequest(
                name=user, perm=auth_pb2.Permission(permType=perm, key=key, range_end=prefix_end(key)))))
        # The password is never used (the certificate names the user); etcd 3.5.1's API has no --no-password.
        steps.append((f"user add {user}", auth.UserAdd,
                      etcdrpc.AuthUserAddRequest(name=user, password=secrets.token_urlsafe(24))))
        steps.append((f"grant {user}", auth.UserGrantRole, etcdrpc.AuthUserGrantRoleRequest(user=user, role=user)))
    return steps


def enable_auth(endpoints: Sequence[str], tls: TlsConfig, prefix: str, *, secrets_dir: Path,
                user: str = ETCD_USER, timeout_s: float = 10.0) -> Path:
    """Create root and a user ``USER-ROLE`` per role of :data:`GRANTS`, turn auth on; returns the root password file."""
    ch = tls_channel(endpoints[0], tls, options=[("grpc.default_authority", endpoints[0])])
    auth = etcdrpc.AuthStub(ch)
    root_pw = secrets.token_urlsafe(24)
    steps = [
        ("user add root", auth.UserAdd, etcdrpc.AuthUserAddRequest(name="root", password=root_pw)),
        ("grant root", auth.UserGrantRole, etcdrpc.AuthUserGrantRoleRequest(user="root", role="root")),
        *_steps(auth, prefix, user),
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
