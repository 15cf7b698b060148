"""Mutual TLS for every connection Rallypoint makes: gRPC, the data plane and etcd.

One :class:`TlsConfig` is a process's identity: the CA it trusts, and its own certificate
and key (PEM files). Every server requires a client certificate signed by the CA
(``require_client_auth``; the data plane's ``CERT_REQUIRED``) and every client verifies
the server's certificate against the CA *and* the address it dialled (IP or DNS
subject-alternative names), so a peer without a certificate of this cluster's CA is
refused at the handshake, before a byte of a request is read.

``None`` in place of a config means plain TCP: the daemons take it only from an explicit
``--insecure`` (see ``docs/security.md``). Helpers here never fall back to plain by
themselves.

Layout of a certificate directory (``rallypoint certs``, :mod:`rallypoint.cluster.certs`)::

    ca.crt                the cluster CA (ca.key beside it signs new certificates)
    <name>.crt <name>.key one per process (c0, w1, client, etcd0, ...)

Every certificate carries a role (``rallypoint://role/ROLE``, :mod:`rallypoint.basics.authz`)
and its common name is the etcd user of that role (``rallypoint-ROLE``): etcd started with
``--client-cert-auth`` takes the user from it, so no password crosses the wire.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from rallypoint.basics.errors import ConfigError

CA_FILE = "ca.crt"
CA_KEY_FILE = "ca.key"
ETCD_USER = "rallypoint"  # the base of the etcd users Rallypoint's certificates name (CN rallypoint-ROLE)
HANDSHAKE_TIMEOUT_S = 10.0


def _read_pem(path: Path, what: str, marker: str) -> bytes:
    hint = "make them with `rallypoint certs --out DIR` (docs/security.md), or pass --insecure for plain TCP"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"TLS {what} {path} does not exist; {hint}") from None
    except OSError as exc:
        raise ConfigError(f"TLS {what} {path} cannot be read ({exc.strerror}); check its permissions") from None
    if marker.encode() not in data:
        raise ConfigError(f"TLS {what} {path} is not a PEM file (no '{marker}' line); {hint}")
    return data


@dataclass(frozen=True)
class TlsConfig:
    """The CA to trust and this process's certificate and key (PEM paths)."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_dir(cls, directory: str | Path, name: str) -> TlsConfig:
        """``DIR/ca.crt``, ``DIR/NAME.crt``, ``DIR/NAME.key``; ConfigError naming a missing or bad file."""
        d = Path(directory)
        if not d.is_dir():
            raise ConfigError(f"TLS directory {d} does not exist; make it with `rallypoint certs --out {d} "
                              f"--names {name}`, or pass --insecure for plain TCP")
        cfg = cls(d / CA_FILE, d / f"{name}.crt", d / f"{name}.key")
        cfg.check()
        return cfg

    def check(self) -> TlsConfig:
        """Raise ConfigError unless all three files are readable PEM (and the pair loads)."""
        self.pem()
        try:
            # A bare client context: the pair is all that is checked (the system's CA store, which a default
            # context loads at ~0.1 s a call in every process that starts, is never used here).
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(self.cert, self.key)
        except ssl.SSLError as exc:
            raise ConfigError(f"TLS key {self.key} does not match certificate {self.cert} ({exc.reason}); "
                              "make both again with `rallypoint certs`") from None
        return self

    def role(self) -> str | None:
        """The role the certificate carries (:mod:`rallypoint.basics.authz`); None: it names none."""
        from rallypoint.basics.authz import role_of_pem

        return role_of_pem(self.pem()[1])

    def check_role(self, role: str) -> TlsConfig:
        """Raise ConfigError unless the certificate carries ``role`` (a process started with another's identity)."""
        has = self.role()
        if has != role:
            name = self.cert.stem
            raise ConfigError(f"TLS certificate {self.cert} has role {has or 'none'}, not {role}: make it with "
                              f"`rallypoint certs --names {name}:{role}` (docs/security.md)")
        return self

    def check_worker(self, worker: str) -> TlsConfig:
        """Raise ConfigError unless the certificate names worker ``worker`` (``rallypoint://worker/ID``): a worker
        with another worker's certificate would be refused by etcd and by every client that dials it."""
        from cryptography import x509

        from rallypoint.basics.authz import worker_of_uris

        try:
            san = x509.load_pem_x509_certificate(self.pem()[1]).extensions.get_extension_for_class(
                x509.SubjectAlternativeName).value
            has = worker_of_uris(san.get_values_for_type(x509.UniformResourceIdentifier))
        except (ValueError, x509.ExtensionNotFound):
            has = None
        if has != worker:
            raise ConfigError(f"TLS certificate {self.cert} names worker {has or 'none'}, not {worker}: make it with "
                              f"`rallypoint certs --names {worker}:worker` (docs/security.md)")
        return self

    def pem(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert, key) bytes."""
        return (_read_pem(self.ca, "CA certificate", "BEGIN CERTIFICATE"),
                _read_pem(self.cert, "certificate", "BEGIN CERTIFICATE"),
                _read_pem(self.key, "private key", "PRIVATE KEY"))

    # -- gRPC -----------------------------------------------------------------------

    def stamp(self) -> tuple[tuple[int, int], ...]:
        """When and how large the three files are: a change means a rotated certificate."""
        out = []
        for p in (self.ca, self.cert, self.key):
            try:
                st = p.stat()
                out.append((st.st_mtime_ns, st.st_size))
            except OSError:
                out.append((0, 0))
        return tuple(out)

    def server_credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials that require and verify a client certificate. They read the files again when
        they change (``rallypoint certs`` made new ones): the next handshake presents the new certificate and trusts
        the new CA file; a pair that does not load yet (half written) keeps the last good one."""
        ca, cert, key = self.pem()
        seen = {"stamp": self.stamp()}

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            stamp = self.stamp()
            if stamp == seen["stamp"]:
                return None
            try:
                self.check()
                ca, cert, key = self.pem()
            except ConfigError:
                return None  # rotated half-way: the old pair serves until both files are new
            seen["stamp"] = stamp
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

        return grpc.dynamic_ssl_server_credentials(
            grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca), fetch,
            require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials: verify the server against the CA, present our certificate."""
        ca, cert, key = self.pem()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    # -- sockets (the data plane, etcd's HTTP health endpoint) ----------------------

    def server_context(self) -> ssl.SSLContext:
        """An SSL server context that requires a client certificate signed by the CA."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(cafile=str(self.ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def reloading(self, make: str) -> ReloadingContext:
        """``server_context`` or ``client_context`` (by name) made again when the files change, for the next
        handshake (the data plane's sockets: a rotated certificate takes effect without a restart)."""
        return ReloadingContext(self, getattr(self, make))

    def client_context(self) -> ssl.SSLContext:
        """An SSL client context: verifies the server's certificate and name, presents ours."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(cafile=str(self.ca))
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


KEEPALIVE: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0))
"""Options of a channel that carries long streams between the cluster's processes (a gang's ``Member`` calls,
pushes, the leader's calls to workers): an HTTP/2 ping every 10 s while a call is open, so a peer that stops
answering (SIGSTOPped, partitioned) breaks the call within ~15 s instead of holding it for ever."""

PERMIT_KEEPALIVE: tuple[tuple[str, Any], ...] = (
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000), ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1))
"""Options of a server whose callers send :data:`KEEPALIVE` pings (gRPC's default answers them with GOAWAY)."""



class ReloadingContext:
    """An SSL context made from a :class:`TlsConfig`'s files, made again at a handshake after they changed
    (a pair that does not load yet keeps the last good context)."""

    def __init__(self, tls: TlsConfig, make: Any) -> None:
        self._tls, self._make = tls, make
        self._stamp, self._ctx = tls.stamp(), make()
        self._lock = threading.Lock()

    def current(self) -> ssl.SSLContext:
        stamp = self._tls.stamp()
        with self._lock:
            if stamp != self._stamp:
                try:
                    self._tls.check()
                    self._ctx, self._stamp = self._make(), stamp
                except (ConfigError, ssl.SSLError, OSError):
                    pass  # rotated half-way: the old context serves until both files are new
            return self._ctx

    def wrap_socket(self, sock: Any, **kwargs: Any) -> ssl.SSLSocket:
        return self.current().wrap_socket(sock, **kwargs)


def channel(address: str, tls: TlsConfig | None, options: Sequence[tuple[str, Any]] = (), *,
            worker: str | None = None) -> grpc.Channel:
    """A gRPC channel to ``address``: mutual TLS with ``tls``, plain only when ``tls`` is None.

    ``worker``: the worker id the server must be. Its certificate must then carry that worker's
    name (``ID.worker.rallypoint``, :func:`rallypoint.basics.authz.worker_server_name`) rather than
    the address: another worker's certificate, or any other role's, is refused at the handshake."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    opts = list(options)
    if worker:
        from rallypoint.basics.authz import worker_server_name

        opts.append(("grpc.ssl_target_name_override", worker_server_name(worker)))
    return grpc.secure_channel(address, tls.channel_credentials(), options=opts)


def add_port(server: grpc.Server, address: str, tls: TlsConfig | None) -> int:
    """Bind ``server`` to ``address`` (mutual TLS with ``tls``); returns the port (0: failed)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def tls_of(obj: Any) -> TlsConfig | None:
    """The TLS identity a store (or other connection holder) was opened with; None for plain or fakes."""
    tls = getattr(obj, "tls", None)
    return tls if isinstance(tls, TlsConfig) else None


# -- the identity of a cluster this process started (for in-process clients) -------------

_PLAIN: Any = object()  # recorded for endpoints known to serve plain TCP (an --insecure cluster)
_known: dict[str, Any] = {}
_known_lock = threading.Lock()


def remember(endpoints: Iterable[str], tls: TlsConfig | None) -> None:
    """Record the client identity for a cluster by its etcd endpoints; None records that it is plain.

    A LocalCluster, an EtcdCluster started without TLS and the CLI's ``--cluster`` with
    ``--tls-dir``/``--insecure`` do it, so :data:`AUTO` clients of those endpoints find it.
    """
    with _known_lock:
        for e in endpoints:
            _known[e] = _PLAIN if tls is None else tls


def forget(endpoints: Iterable[str]) -> None:
    """Drop what :func:`remember` recorded for ``endpoints`` (a stopped cluster's ports may be reused)."""
    with _known_lock:
        for e in endpoints:
            _known.pop(e, None)


class _Auto:
    def __repr__(self) -> str:
        return "AUTO"


AUTO: Any = _Auto()
"""``tls=AUTO``: the identity :func:`remember` recorded for the endpoints; an error when none was."""


def resolve(tls: TlsConfig | None | _Auto, endpoints: Iterable[str]) -> TlsConfig | None:
    """``tls`` itself, or for :data:`AUTO` the identity recorded for ``endpoints``.

    Raises:
        ConfigError: :data:`AUTO` and nothing was recorded for any of ``endpoints``. There is
            no fall-back to plain TCP: a client must say which identity it uses, or ``None``
            (plain) for an etcd started without TLS.
    """
    if not isinstance(tls, _Auto):
        return tls
    endpoints = list(endpoints)
    with _known_lock:
        for e in endpoints:
            if e in _known:
                found = _known[e]
                return None if found is _PLAIN else found
    raise ConfigError(f"no TLS identity for etcd at {','.join(endpoints)}: pass one (tls=TlsConfig.from_dir(DIR, "
                      "NAME); the CLI's --tls-dir DIR), or tls=None (--insecure) for an etcd started without TLS. "
                      "Rallypoint never falls back to plain TCP by itself")

