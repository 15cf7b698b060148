"""The coordinator's live dashboard: a small HTTP server with a route table (docs/dashboard.md).

Every coordinator serves it (``--dashboard-port``; ``--dashboard-host``, loopback by
default). Routes:

* ``/``: the page (:data:`rallypoint.orchestrator.observe.page.PAGE`: one HTML string with
  inline CSS and JS, no external assets), which polls ``/api/cluster`` every 0.5 s;
* ``/api/cluster``: JSON (:func:`cluster_json`): this coordinator, the leader and its
  dashboard address, the workers (from etcd), the jobs (the leader's
  :class:`~rallypoint.orchestrator.observe.timeline.TimelineRecorder`, then the job records in
  etcd) each with its timeline and its metric curves as inline SVGs (:func:`timeline_svg`,
  :func:`metrics_svg`).

Other endpoints mount with :meth:`DashboardServer.mount` (a path and a handler returning
``(status, content type, body)``). The server only answers GET and HEAD; on a loopback
address it answers only requests whose ``Host`` names that address (no DNS rebinding).
"""

from __future__ import annotations

import ipaddress
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from rallypoint.etcd.cluster_view import ClusterSnapshot, job_records, read_cluster
from rallypoint.etcd.records import parsed
from rallypoint.basics.errors import ConfigError, StoreError
from rallypoint.basics.logs import get_logger
from rallypoint.orchestrator.observe.page import PAGE
from rallypoint.orchestrator.observe.metrics_svg import metrics_svg
from rallypoint.orchestrator.observe.timeline_svg import timeline_svg

if TYPE_CHECKING:
    from rallypoint.orchestrator.service.coordinator import Coordinator
    from rallypoint.orchestrator.service.jobs import CoordinatorService

Response = tuple[int, str, bytes]
Handler = Callable[[dict[str, list[str]]], Response]
JSON_TYPE = "application/json; charset=utf-8"
CACHE_S = 0.2  # /api/cluster reads etcd at most this often, however many pages poll it
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def json_response(body: Any, status: int = 200) -> Response:
    return status, JSON_TYPE, json.dumps(body).encode()


class DashboardServer:
    """A threaded HTTP server in a daemon thread, with a table of GET routes."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.routes: dict[str, Handler] = {}
        try:
            self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        except OSError as exc:
            raise ConfigError(f"cannot serve the dashboard on {host}:{port}: {exc.strerror or exc}") from None
        self._httpd.daemon_threads = True
        self.host, self.port = host, int(self._httpd.server_address[1])
        self.loopback = _is_loopback(host)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="dashboard", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def mount(self, path: str, handler: Handler) -> None:
        """Serve GET ``path`` with ``handler(query) -> (status, content type, body)``."""
        if not path.startswith("/"):
            raise ValueError(f"a route is an absolute path, got {path!r}")
        self.routes[path] = handler

    def start(self) -> DashboardServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()

    def allowed_host(self, host_header: str | None) -> bool:
        """On a loopback address, only ``Host: <loopback name>:<port>`` (a page of another site
        that a DNS trick pointed here names its own host, and gets nothing)."""
        if not self.loopback:
            return True
        names = {f"127.0.0.1:{self.port}", f"localhost:{self.port}", f"[::1]:{self.port}", f"{self.host}:{self.port}"}
        return (host_header or "").strip().lower() in names

    def respond(self, target: str, host_header: str | None) -> Response:
        """The response to ``GET target``."""
        if not self.allowed_host(host_header):
            return 421, "text/plain; charset=utf-8", b"misdirected request: use the dashboard's own address\n"
        parts = urlsplit(target)
        handler = self.routes.get(parts.path)
        if handler is None:
            return 404, "text/plain; charset=utf-8", b"not found\n"
        return handler(parse_qs(parts.query))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _make_handler(server: DashboardServer) -> type[BaseHTTPRequestHandler]:
    log = get_logger("rallypoint.dashboard")

    class _Handler(BaseHTTPRequestHandler):
        server_version = "rallypoint-dashboard"
        sys_version = ""

        def _send(self, head_only: bool) -> None:
            try:
                status, ctype, body = server.respond(self.path, self.headers.get("Host"))
            except Exception as exc:  # a broken route answers 500, the server goes on
                log.exception("dashboard.route_failed", path=self.path, error=repr(exc))
                status, ctype, body = 500, "text/plain; charset=utf-8", b"internal error\n"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in SECURITY_HEADERS.items():
                self.send_header(k, v)
            self.end_headers()
            if not head_only:
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (the http.server API)
            self._send(head_only=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._send(head_only=True)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # one line per poll would drown the coordinator's log

    return _Handler


# -- /api/cluster ---------------------------------------------------------------------------


def workers_json(snap: ClusterSnapshot) -> list[dict[str, Any]]:
    """Live workers (state, incarnation, devices, cordon, what holds them), then the lost ones."""
    rows = []
    for w, s in sorted(snap.workers.items()):
        held = sorted({(h.job, h.slice) for h in s.holders.values()})
        rows.append({"worker": w, "state": s.state, "alive": True, "incarnation": s.info.incarnation,
                     "pid": s.info.pid, "address": s.info.address, "devices": len(s.devices), "free": len(s.free),
                     "cordoned": s.cordoned, "held_by": [{"job": j, "slice": sl} for j, sl in held]})
    for w, rec in sorted(snap.lost.items()):
        if w not in snap.workers:
            rows.append({"worker": w, "state": "lost", "alive": False, "incarnation": rec.get("incarnation", 0),
                         "pid": rec.get("pid", 0), "address": rec.get("address", ""), "devices": 0, "free": 0,
                         "cordoned": False, "held_by": [], "lost_reason": rec.get("reason", ""),
                         "lost_at": rec.get("at")})
    return rows


def jobs_json(recorded: list[dict[str, Any]], records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The jobs this coordinator recorded (with timelines), then the other job records of etcd."""
    out = []
    for j in recorded:
        j = dict(j)
        j["timeline_svg"] = timeline_svg(j["timeline"])
        j["metrics_svg"] = metrics_svg(j.get("metrics") or {}, j.get("marks") or [], int(j.get("steps") or 0))
        out.append(j)
    seen = {j["job"] for j in out}
    for name, r in sorted(records.items()):
        if name in seen:
            continue
        out.append({"job": name, "state": str(r.get("state", "")), "priority": r.get("priority", 0),
                    "steps": r.get("steps", 0), "step_done": r.get("step_done", 0), "steps_per_s": None,
                    "devices_held": sum(sum(len(m.get("devices", ())) for m in p.get("members") or [p])
                                        for p in (r.get("placement") or {}).values()),
                    "placement": r.get("placement") or {}, "recoveries": r.get("recoveries") or [],
                    "drains": r.get("drains") or [], "failures": r.get("failures") or [],
                    "reason": str(r.get("reason", "")), "term": r.get("term"), "timeline_svg": "", "metrics_svg": "",
                    "from_record": True})
    return out


def cluster_json(*, cluster: str, coordinator: str, leading: bool, leader: dict[str, Any] | None,
                 snap: ClusterSnapshot | None, recorded: list[dict[str, Any]],
                 records: dict[str, dict[str, Any]], now: float, error: str = "") -> dict[str, Any]:
    """The body of ``/api/cluster`` (pure: the caller reads etcd and the recorder)."""
    return {
        "cluster": cluster, "coordinator": coordinator, "leading": leading, "leader": leader, "now": now,
        "workers": workers_json(snap) if snap is not None else [],
        "jobs": jobs_json(recorded if leading else [j for j in recorded if j.get("ended_at")], records),
        "error": error,
    }


class ClusterApi:
    """``/api/cluster`` of one coordinator: etcd read at most every ``CACHE_S``, plus the recorder."""

    def __init__(self, coordinator: Coordinator, service: CoordinatorService | None) -> None:
        self.c, self.service = coordinator, service
        self._lock = threading.Lock()
        self._cached: tuple[float, Response] | None = None

    def _leader(self) -> dict[str, Any] | None:
        kv = self.c.store.get(self.c.keys.leader)
        v = parsed(kv, "leader")
        if kv is None or v is None:
            return None
        return {"coordinator": v.get("coordinator"), "term": kv.create_revision, "address": v.get("address"),
                "dashboard": v.get("dashboard")}

    def build(self) -> dict[str, Any]:
        snap, leader, records, error = None, None, {}, ""
        try:
            snap = read_cluster(self.c.store, self.c.keys)
            leader = self._leader()
            records = job_records(self.c.store, self.c.keys)
        except StoreError as exc:
            error = f"etcd unreachable: {exc}"
        recorded = self.service.timeline.jobs() if self.service is not None else []
        return cluster_json(cluster=self.c.keys.cluster, coordinator=self.c.config.coordinator_id,
                            leading=self.c.election.is_leader, leader=leader, snap=snap, recorded=recorded,
                            records=records, now=self.c.clock.wall(), error=error)

    def __call__(self, query: dict[str, list[str]]) -> Response:
        with self._lock:
            now = self.c.clock.monotonic()
            if self._cached is None or now - self._cached[0] >= CACHE_S:
                self._cached = (now, json_response(self.build()))
            return self._cached[1]


def start_dashboard(coordinator: Coordinator, service: CoordinatorService | None, *, host: str = "127.0.0.1",
                    port: int = 0) -> DashboardServer:
    """Serve the dashboard of ``coordinator`` and publish its address (before :meth:`Coordinator.run`)."""
    server = DashboardServer(host, port)
    server.mount("/", lambda _q: (200, "text/html; charset=utf-8", PAGE.encode()))
    server.mount("/api/cluster", ClusterApi(coordinator, service))
    server.start()
    coordinator.election.published["dashboard"] = server.url
    coordinator.log.info("dashboard.serving", url=server.url, host=host, port=server.port)
    return server
