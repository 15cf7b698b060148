"""The Prometheus endpoint every daemon may serve.

Each coordinator and worker serves its own :class:`prometheus_client.CollectorRegistry`
(never the process-global default, so several in one test process do not clash) over
prometheus_client's HTTP server on ``--metrics-port`` (0: a free port). The address it
got goes into the process's etcd record, where
:func:`rallypoint.etcd.metrics_targets.read_metrics_targets` finds it. The metrics
themselves are in ``docs/metrics.md``; the collectors in ``orchestrator/observe/metrics.py`` and
``workers/metrics.py``.

The server is prometheus_client's WSGI app on the standard library's threading WSGI
server, polled every :data:`POLL_S`: ``start_http_server`` polls every 0.5 s, and a
daemon's clean exit waited that long for its endpoint to close.
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

POLL_S = 0.05
"""How often the server's loop looks for :meth:`MetricsServer.close` (its shutdown waits at most this)."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass  # a scrape is not worth a line on stderr


class MetricsServer:
    """The HTTP endpoint of one registry, in a daemon thread, until :meth:`close`."""

    def __init__(self, registry: CollectorRegistry, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.registry = registry
        server = _Server6 if ":" in host else _Server
        self._httpd = make_server(host, port, make_wsgi_app(registry), server, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": POLL_S},
                                        name="metrics-http", daemon=True)
        self._thread.start()
        bound_host, bound_port = self._httpd.server_address[:2]
        self.address = f"{host or bound_host}:{bound_port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2.0)
