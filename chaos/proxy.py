"""A loopback TCP proxy that can cut or freeze the connections through it (anyone may run it).

:class:`TcpProxy` listens on a free 127.0.0.1 port and forwards to a target with
threads and plain sockets. ``cut()`` resets every open connection and black-holes new
ones; ``cut(freeze=True)`` stalls open ones instead, as a network partition does, and
``restore()`` lets them flow again. The chaos harness's ``proxy`` mode puts one in
front of each of a worker's paths (:class:`rallypoint.chaos.network.ProxyPartitions`),
the fallback where network namespaces are unavailable.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class _Pair:
    """One proxied connection: the accepted socket and the one to the target."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.socks = (client, upstream)
        self.dead = threading.Event()
        self._lock = threading.Lock()
        self._running = 2  # pump threads, one per direction

    def kill(self) -> None:
        with self._lock:
            if self.dead.is_set():
                return
            self.dead.set()
        for s in self.socks:
            _reset(s)

    def pump_done(self) -> bool:
        """One direction finished; True (and both sockets closed) when it was the last."""
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            for s in self.socks:
                with contextlib.suppress(OSError):
                    s.close()
        return last


def _reset(s: socket.socket) -> None:
    """Close ``s`` with a RST (linger 0); wakes a thread blocked reading it."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        s.close()


class TcpProxy:
    """A TCP proxy on a free 127.0.0.1 port forwarding to ``target`` (threads and sockets).

    :meth:`cut` resets every open connection and black-holes new ones (accepted, never
    forwarded, reset on :meth:`restore`). ``cut(freeze=True)`` is the partition-like
    variant: open connections stay open but nothing moves in either direction, new
    ones hang, and :meth:`restore` lets all of them flow again (as TCP does after a
    healed partition). ``target`` may be changed while it runs (new connections go
    there). Counters: ``forwarded`` (connections), ``dropped`` (connections accepted
    while cut), ``cuts``.
    """

    def __init__(self, target: tuple[str, int] | str, *, host: str = "127.0.0.1") -> None:
        if isinstance(target, str):
            thost, _, tport = target.rpartition(":")
            target = (thost, int(tport))
        self.target = target
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.2)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self.cut_now = False
        self.frozen = False
        self.forwarded = self.dropped = self.cuts = 0
        self._flowing = threading.Event()
        self._flowing.set()
        self._pairs: set[_Pair] = set()
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"proxy-{self.address}", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                if self.cut_now or self._closed.is_set():
                    self._held.append(conn)
                    self.dropped += 1
                    continue
            threading.Thread(target=self._open, args=(conn,), daemon=True).start()

    def _open(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=2.0)
        except OSError:
            _reset(conn)
            return
        pair = _Pair(conn, upstream)
        with self._lock:
            if (self.cut_now and not self.frozen) or self._closed.is_set():
                pair.kill()
                return
            self._pairs.add(pair)
            self.forwarded += 1
        for sock in pair.socks:
            sock.settimeout(0.2)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._pump, args=(pair, conn, upstream), daemon=True).start()
        self._pump(pair, upstream, conn)

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not pair.dead.is_set():
                if not self._flowing.wait(0.2):
                    continue  # frozen: leave the bytes where they are
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    if not pair.dead.is_set():
                        with contextlib.suppress(OSError):
                            dst.shutdown(socket.SHUT_WR)  # pass the half-close on
                    return
                view = memoryview(data)
                while view:
                    if pair.dead.is_set():
                        return
                    if not self._flowing.wait(0.2):
                        continue
                    try:
                        view = view[dst.send(view):]
                    except TimeoutError:
                        continue
        except OSError:
            pair.kill()
        finally:
            if pair.pump_done() or pair.dead.is_set():
                with self._lock:
                    self._pairs.discard(pair)

    def cut(self, *, freeze: bool = False) -> None:
        """Reset every open connection (``freeze``: stall it) and black-hole new ones until :meth:`restore`."""
        with self._lock:
            self.cut_now, self.frozen = True, freeze
            self.cuts += 1
            self._flowing.clear()
            pairs = [] if freeze else list(self._pairs)
            if not freeze:
                self._pairs = set()
        for p in pairs:
            p.kill()
        if not freeze:
            self._flowing.set()  # nothing is left open to stall

    def restore(self) -> None:
        """Forward again. Connections accepted while cut are reset, or (after a freeze) forwarded."""
        with self._lock:
            frozen = self.frozen and not self._closed.is_set()
            self.cut_now = self.frozen = False
            held, self._held = self._held, []
            self._flowing.set()
        for conn in held:
            if frozen:
                threading.Thread(target=self._open, args=(conn,), daemon=True).start()
            else:
                _reset(conn)

    def close(self) -> None:
        """Stop listening and reset everything (idempotent)."""
        self._closed.set()
        self.cut()
        self.restore()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(timeout=2)
