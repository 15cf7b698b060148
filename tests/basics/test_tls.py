"""Which identity a client of etcd endpoints uses: never plain TCP unless asked or recorded (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint.basics import tls
from rallypoint.basics.errors import ConfigError


def test_auto_without_a_recorded_identity_is_an_error_not_plain_tcp(tmp_path: Path) -> None:
    # Endpoints no other test records (the record is the process's: a test before this one in the same process,
    # e.g. a coordinator built for 127.0.0.1:1, may have recorded that address as plain).
    endpoints = ["tls-auto.invalid:1", "tls-auto.invalid:2"]
    with pytest.raises(ConfigError, match=r"no TLS identity for etcd at tls-auto\.invalid:1,tls-auto\.invalid:2.*--tls-dir"):
        tls.resolve(tls.AUTO, endpoints)
    assert tls.resolve(None, endpoints) is None  # plain only when asked for
    ident = tls.TlsConfig(tmp_path / "ca.crt", tmp_path / "c.crt", tmp_path / "c.key")
    try:
        tls.remember(endpoints[1:], ident)
        assert tls.resolve(tls.AUTO, endpoints) is ident
        tls.remember(endpoints[1:], None)  # an --insecure cluster is recorded as plain
        assert tls.resolve(tls.AUTO, endpoints) is None
    finally:
        tls.forget(endpoints)
    with pytest.raises(ConfigError):
        tls.resolve(tls.AUTO, endpoints)
