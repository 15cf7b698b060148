"""etcd authentication for a cluster: a user with read-write on the cluster's prefix only.

:func:`enable_auth` does on a fresh etcd (TLS with ``--client-cert-auth``) what
``docs/security.md`` lists as etcdctl commands for a production etcd::

    user add root (random password)        user grant-role root root
    role add rallypoint                    role grant-permission rallypoint readwrite --prefix PREFIX
    user add rallypoint (random password)  user grant-role rallypoint rallypoint
    auth enable

(PREFIX: the cluster's :attr:`~rallypoint.etcd.keys.Keys.prefix`.)

Rallypoint's processes never send a password: etcd takes the user from the common name
of their client certificate (``rallypoint``, :data:`~rallypoint.basics.tls.ETCD_USER`), so
there is no auth token to expire and renew. The root password is written (mode 0600) for
an operator's ``etcdctl --user root``; nothing in Rallypoint reads it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from rallypoint.basics.errors import StoreError
from rallypoint.etcd.store import prefix_end
from rallypoint.basics.tls import ETCD_USER, TlsConfig
from rallypoint.basics.tls import channel as tls_channel

ROOT_PASSWORD_FILE = "root.password"


def enable_auth(endpoints: Sequence[str], tls: TlsConfig, prefix: str, *, secrets_dir: Path,
                user: str = ETCD_USER, timeout_s: float = 10.0) -> Path:
    """Create root and ``user`` (read-write on ``prefix`` only) and turn auth on; returns the root password file."""
    ch = tls_channel(endpoints[0], tls, options=[("grpc.default_authority", endpoints[0])])
    auth = etcdrpc.AuthStub(ch)
    root_pw = secrets.token_urlsafe(24)
    key = prefix.encode()
    steps = [
        ("user add root", auth.UserAdd, etcdrpc.AuthUserAddRequest(name="root", password=root_pw)),
        ("grant root", auth.UserGrantRole, etcdrpc.AuthUserGrantRoleRequest(user="root", role="root")),
        (f"role add {user}", auth.RoleAdd, etcdrpc.AuthRoleAddRequest(name=user)),
        (f"grant {prefix}", auth.RoleGrantPermission, etcdrpc.AuthRoleGrantPermissionRequest(
            name=user, perm=auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=key,
                                                range_end=prefix_end(key)))),
        # The password is never used (the certificate names the user); etcd 3.5.1's API has no --no-password.
        (f"user add {user}", auth.UserAdd, etcdrpc.AuthUserAddRequest(name=user, password=secrets.token_urlsafe(24))),
        (f"grant {user}", auth.UserGrantRole, etcdrpc.AuthUserGrantRoleRequest(user=user, role=user)),
    ]
    secrets_dir.mkdir(parents=True, exist_ok=True)
    pw_file = secrets_dir / ROOT_PASSWORD_FILE
    fd = os.open(pw_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(root_pw + "\n")
    try:
        for what, call, request in steps:
            try:
                call(request, timeout=timeout_s)
            except grpc.RpcError as exc:
                raise StoreError(f"etcd auth setup failed at `{what}`: {exc.code().name} {exc.details()}") from None
        try:
            auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise StoreError(f"etcd auth enable failed: {exc.code().name} {exc.details()}") from None
    finally:
        ch.close()
    return pw_file
