"""The tensor data plane: values move worker to worker over plain TCP, zero-copy.

gRPC stays the control plane (loading jobs, granting steps, completions). Tensor
payloads take this path because Python gRPC tops out far below the loopback
socket here (measured by ``bench/dispatch.py``: about 0.15x): each chunk is copied
into a protobuf, serialized, copied again by gRPC and joined on receipt. Here the
sender hands each leaf's own buffer to ``sendall`` and the receiver ``recv_into``
a freshly allocated array of the right dtype and shape: no intermediate copy.

One value is one frame on a connection (connections are pooled per peer and reused)::

    b"RPV1" | u32 header length | TransferHeader (protobuf)
    per leaf: u32 meta length | Tensor without data (dtype, shape) | raw C-order bytes

and the receiver answers one status byte (``DELIVERED``, ``DUPLICATE``, ``REFUSED``,
``NO_JOB``, ``INVALID``), followed for the last three by a u32 length and a message.
The header carries the same identities as a gRPC ``Push`` (the receiving worker's
incarnation), and the receiver admits it through the same gate.

With a :class:`~rallypoint.basics.tls.TlsConfig` every connection is mutual TLS (the server
requires a client certificate of the cluster CA, the client checks the server's name and
certificate); the handshake runs on the connection's own thread, bounded by
``HANDSHAKE_DEADLINE_S``, and at most ``MAX_UNAUTHENTICATED`` connections are in their handshake at once
(more are closed at once, counted); the accept loop logs and counts any error and goes on. A malformed frame (bad magic, header, dtype or shape; a value
over the limits) is answered ``INVALID`` when the stream still allows it, and the
connection is closed: the handler never sees it.
"""

from __future__ import annotations

import enum
import queue
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from google.protobuf.message import DecodeError

from rallypoint.basics import authz
from rallypoint.basics.logs import get_logger
from rallypoint.basics.tls import HANDSHAKE_TIMEOUT_S, TlsConfig
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto.codec import leaf_meta

MAGIC = b"RPV1"
_U32 = struct.Struct("!I")
MAX_HEADER_BYTES = 1 << 20
MAX_META_BYTES = 1 << 16
MAX_LEAVES = 1 << 16
MAX_LEAF_BYTES = 1 << 36  # 64 GiB: a bound on what one leaf makes the receiver allocate
MAX_VALUE_BYTES = 1 << 36  # and on what one frame (all its leaves) does
MAX_UNAUTHENTICATED = 64
"""Connections accepted whose TLS handshake has not finished (each holds a thread for at most
``HANDSHAKE_DEADLINE_S``): one more is closed at once, unread, so a flood of idle connections costs
neither threads nor the accept loop."""
MAX_CONNECTIONS = 1024
"""Connections served at once, authenticated ones included (a peer pools one per value in flight)."""
HANDSHAKE_DEADLINE_S = min(HANDSHAKE_TIMEOUT_S, 5.0)
"""How long a connection may take to finish its TLS handshake (``--insecure`` plain TCP has none: no limit holds
there but ``MAX_CONNECTIONS``)."""
ACCEPT_ERROR_PAUSE_S = 0.05  # after an error of accept() (out of file descriptors): a pause, not a spin


class FrameError(ValueError):
    """A malformed data-plane frame; the connection is closed after the answer."""


class Status(enum.IntEnum):
    DELIVERED = 0
    DUPLICATE = 1
    REFUSED = 2  # the receiver may not act now, or the request names another incarnation
    NO_JOB = 3  # the receiver does not hold the job
    INVALID = 4  # malformed or unexpected value


class DataPlaneError(Exception):
    """A transfer did not go through. ``status`` is None when the connection failed."""

    def __init__(self, status: Status | None, message: str) -> None:
        super().__init__(message)
        self.status = status

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status is Status.REFUSED


Handler = Callable[[pb.TransferHeader, list[np.ndarray]], tuple[Status, str]]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        got += n


def _leaf_array(meta: pb.Tensor, left: int = MAX_VALUE_BYTES) -> np.ndarray:
    """An empty array for a leaf's (dtype, shape); FrameError for anything but plain numeric data, or for more
    than ``MAX_LEAF_BYTES``, or than ``left`` (what the frame's earlier leaves left of ``MAX_VALUE_BYTES``)."""
    try:
        dtype, shape, nbytes = leaf_meta(meta.dtype, meta.shape, MAX_LEAF_BYTES)  # the codec's checks, one place
    except ValueError as exc:
        raise FrameError(str(exc)) from None
    if nbytes > left:
        raise FrameError(f"a leaf of {nbytes} bytes takes the frame over its limit of {MAX_VALUE_BYTES}")
    try:
        return np.empty(shape, dtype=dtype)
    except (ValueError, MemoryError) as exc:
        raise FrameError(f"cannot allocate a leaf of shape {shape} and dtype {dtype}: {exc}") from None


def _c_order(a: Any) -> np.ndarray:
    arr = np.asarray(a)
    return arr if arr.flags.c_contiguous else np.array(arr, order="C")


class DataPlaneServer:
    """Accepts data-plane connections and hands each received value to ``handler``.

    Args:
        host: address to listen on.
        handler: ``(header, leaves) -> (status, message)``; runs on the connection's thread.
        port: 0 picks a free port.
        tls: mutual TLS (None: plain TCP, only when asked for with ``--insecure``).
    """

    def __init__(self, host: str, handler: Handler, port: int = 0, *, tls: TlsConfig | None = None) -> None:
        self.handler = handler
        self._tls = tls.reloading("server_context") if tls is not None else None  # a rotated certificate: next handshake
        self._sock = socket.create_server((host, port))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._unauthenticated = threading.BoundedSemaphore(MAX_UNAUTHENTICATED)
        self._serving = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused_connections = 0  # closed at once, over a limit above
        self.accept_errors = 0  # errors of the accept loop, logged; it goes on
        self.log = get_logger("rallypoint.dataplane", address=self.address)
        self._thread = threading.Thread(target=self._accept, name="dataplane-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _accept(self) -> None:
        """Accept until stopped. Nothing a peer does ends this loop: every error is logged, counted and passed."""
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._stop.is_set():
                    return
                self._accept_failed("accept", exc)
                time.sleep(ACCEPT_ERROR_PAUSE_S)  # e.g. out of file descriptors: they come back as threads end
                continue
            try:
                self._admit(conn)
            except Exception as exc:  # noqa: BLE001 - a thread that cannot start, a socket option refused...
                self._accept_failed("admit", exc)
                self._drop(conn)

    def _admit(self, conn: socket.socket) -> None:
        """Serve ``conn`` on its own thread, or close it at once when over a limit."""
        if not self._serving.acquire(blocking=False):
            self._over_limit(conn, f"{MAX_CONNECTIONS} connections served at once")
            return
        if not self._unauthenticated.acquire(blocking=False):
            self._serving.release()
            self._over_limit(conn, f"{MAX_UNAUTHENTICATED} connections not yet authenticated")
            return
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="dataplane-conn", daemon=True).start()
        except BaseException:
            self._unauthenticated.release()
            self._serving.release()
            raise

    def _over_limit(self, conn: socket.socket, limit: str) -> None:
        with self._lock:
            self.refused_connections += 1
            n = self.refused_connections
        if n & (n - 1) == 0:  # 1, 2, 4, 8...: a flood is said, not logged line by line
            self.log.warning("dataplane.connection_refused", limit=limit, refused=n)
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)
        try:
            conn.close()
        except OSError:
            pass

    def _accept_failed(self, where: str, exc: BaseException) -> None:
        with self._lock:
            self.accept_errors += 1
        self.log.warning("dataplane.accept_failed", where=where, error=f"{type(exc).__name__}: {exc}",
                         errors=self.accept_errors)

    def _handshake(self, conn: socket.socket) -> socket.socket | None:
        """The TLS side of an accepted connection (None: the peer failed the handshake, closed)."""
        if self._tls is None:
            return conn
        try:
            conn.settimeout(HANDSHAKE_DEADLINE_S)
            tconn = self._tls.wrap_socket(conn, server_side=True)
            tconn.settimeout(None)
        except (OSError, ssl.SSLError, ValueError) as exc:
            self.log.warning("dataplane.handshake_refused", error=str(exc))
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            return None
        with self._lock:
            self._conns.discard(conn)
            self._conns.add(tconn)
        return tconn

    def _refusal(self, conn: socket.socket) -> str | None:
        """Why the peer's role may not send here (None: it may, or plain TCP has no certificate to check)."""
        if self._tls is None or not isinstance(conn, ssl.SSLSocket):
            return None
        return authz.refusal(authz.DATA_PLANE, authz.role_of_peercert(conn.getpeercert()))

    def _refuse(self, conn: socket.socket, why: str) -> None:
        """Answer REFUSED before reading a frame, then discard what the peer still sends (no RST eats the answer)."""
        self.log.warning("dataplane.role_refused", error=why)
        data = why.encode()[:4096]
        conn.sendall(bytes([Status.REFUSED]) + _U32.pack(len(data)) + data)
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S  # a bound on what a refused peer costs
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        while time.monotonic() < deadline and conn.recv(1 << 16):
            pass

    def _serve(self, raw: socket.socket) -> None:
        try:
            conn = self._handshake(raw)
        except Exception as exc:  # noqa: BLE001 - whatever a handshake raises ends this connection only
            self.log.warning("dataplane.handshake_refused", error=f"{type(exc).__name__}: {exc}")
            self._drop(raw)
            conn = None
        finally:
            self._unauthenticated.release()  # authenticated or closed: the next one may begin
        if conn is None:
            self._serving.release()
            return
        try:
            refused = self._refusal(conn)
            while not self._stop.is_set():
                first = conn.recv(1)
                if not first:
                    return  # the peer closed an idle connection
                if refused is not None:
                    self._refuse(conn, refused)
                    return
                magic = first + _recv_exact(conn, len(MAGIC) - 1)
                if magic != MAGIC:
                    raise FrameError(f"not a data-plane frame: {magic!r}")
                header, leaves = self._read_value(conn)
                try:
                    status, message = self.handler(header, leaves)
                except Exception as exc:  # a handler bug must not kill the connection silently
                    self.log.warning("dataplane.handler_failed", error=f"{type(exc).__name__}: {exc}")
                    status, message = Status.INVALID, f"{type(exc).__name__}: {exc}"
                if status in (Status.DELIVERED, Status.DUPLICATE):
                    conn.sendall(bytes([status]))
                else:
                    data = message.encode()
                    conn.sendall(bytes([status]) + _U32.pack(len(data)) + data)
        except FrameError as exc:
            self.log.warning("dataplane.malformed_frame", error=str(exc))
            data = str(exc).encode()[:4096]
            try:
                conn.sendall(bytes([Status.INVALID]) + _U32.pack(len(data)) + data)
            except OSError:
                pass
        except (ConnectionError, OSError, ValueError) as exc:
            if not self._stop.is_set():
                self.log.info("dataplane.connection_closed", error=str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug here ends this connection, never more
            self.log.warning("dataplane.connection_failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            self._serving.release()
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    @staticmethod
    def _read_message(conn: socket.socket, cls: Any, what: str, limit: int) -> Any:
        """One length-prefixed protobuf message; FrameError over ``limit`` bytes or when it does not parse."""
        (n,) = _U32.unpack(_recv_exact(conn, 4))
        if n > limit:
            raise FrameError(f"{what} of {n} bytes is over the limit of {limit}")
        try:
            return cls.FromString(_recv_exact(conn, n))
        except DecodeError as exc:
            raise FrameError(f"bad {what}: {exc}") from None

    @staticmethod
    def _read_value(conn: socket.socket) -> tuple[pb.TransferHeader, list[np.ndarray]]:
        header = DataPlaneServer._read_message(conn, pb.TransferHeader, "header", MAX_HEADER_BYTES)
        if header.leaves > MAX_LEAVES:
            raise FrameError(f"{header.leaves} leaves is over the limit of {MAX_LEAVES}")
        leaves = []
        total = 0
        for _ in range(header.leaves):
            meta = DataPlaneServer._read_message(conn, pb.Tensor, "leaf metadata", MAX_META_BYTES)
            if meta.data:
                raise FrameError("leaf metadata carries data (the bytes follow it raw)")
            arr = _leaf_array(meta, MAX_VALUE_BYTES - total)
            total += arr.nbytes
            if arr.nbytes:
                _recv_into(conn, memoryview(arr).cast("B"))
            leaves.append(arr)
        return header, leaves

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()


def _pool(address: str, worker: str) -> str:
    """The idle connections to ``address`` checked to be ``worker`` (all of them to the address: no worker named)."""
    return f"{worker}@{address}" if worker else address


class DataPlaneClient:
    """Sends values to peers' data planes over pooled connections (one per value in flight)."""

    def __init__(self, *, timeout_s: float = 120.0, tls: TlsConfig | None = None) -> None:
        self.timeout_s = timeout_s
        self._tls = tls.reloading("client_context") if tls is not None else None
        self._idle: dict[str, queue.SimpleQueue[socket.socket]] = {}
        self._lock = threading.Lock()

    def _connect(self, address: str, worker: str = "") -> socket.socket:
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is None:
            return sock
        try:
            tsock = self._tls.wrap_socket(sock, server_hostname=host)  # checks the name we dialled
        except (OSError, ssl.SSLError):
            sock.close()
            raise
        got = authz.worker_of_peercert(tsock.getpeercert())
        if worker and got != worker:  # another worker's certificate (or none) at the address: not who we send to
            tsock.close()
            raise ssl.SSLError(f"the data plane at {address} is worker {got or '(none named)'}, not {worker}")
        return tsock

    def _checkout(self, address: str, worker: str = "") -> socket.socket:
        with self._lock:
            idle = self._idle.setdefault(_pool(address, worker), queue.SimpleQueue())
        try:
            return idle.get_nowait()
        except queue.Empty:
            return self._connect(address, worker)

    def send(self, address: str, header: pb.TransferHeader, leaves: Sequence[Any]) -> bool:
        """Send one value; returns whether the peer already had it (a duplicate).

        Raises:
            DataPlaneError: refused or invalid (``status`` set), or the connection failed.
        """
        header.leaves = len(leaves)
        arrays = [_c_order(x) for x in leaves]
        head = header.SerializeToString()
        try:
            sock = self._checkout(address, header.to.worker_id)  # the receiver's certificate must name it
        except OSError as exc:
            raise DataPlaneError(None, f"cannot connect to {address}: {exc}") from None
        try:
            sock.sendall(MAGIC + _U32.pack(len(head)) + head)
            for a in arrays:
                meta = pb.Tensor(dtype=a.dtype.name, shape=a.shape).SerializeToString()
                sock.sendall(_U32.pack(len(meta)) + meta)
                if a.nbytes:
                    sock.sendall(memoryview(a).cast("B"))
            status = Status(_recv_exact(sock, 1)[0])
            message = ""
            if status not in (Status.DELIVERED, Status.DUPLICATE):
                (n,) = _U32.unpack(_recv_exact(sock, 4))
                message = _recv_exact(sock, n).decode(errors="replace")
        except (OSError, ConnectionError, ValueError) as exc:
            sock.close()
            raise DataPlaneError(None, f"transfer to {address} broke: {exc}") from None
        self._idle[_pool(address, header.to.worker_id)].put(sock)
        if status is Status.DUPLICATE:
            return True
        if status is not Status.DELIVERED:
            raise DataPlaneError(status, message)
        return False

    def close(self) -> None:
        with self._lock:
            pools, self._idle = list(self._idle.values()), {}
        for pool in pools:
            while True:
                try:
                    pool.get_nowait().close()
                except queue.Empty:
                    break
