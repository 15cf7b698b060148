"""A multi-host slice's members on their workers: the worker daemon's side and the driver's (docs/multihost.md).

Each member of a slice's JAX distributed group runs on its own worker, as a process that
worker's daemon starts and supervises. The slice's driver reaches it through the daemon's
``WorkerRuntime.Member`` call, a gRPC stream both ways with the worker's mutual TLS:

* :func:`relay` (the daemon): the call's first request carries the member's settings; the
  daemon fills in its own host (where the member's collectives listen, and, for member 0,
  the group's coordinator on a port free there), starts the member process
  (:mod:`rallypoint.workers.gang.member`), answers ``{"pid", "coordinator"}`` and then relays
  the member's protocol byte for byte: requests to its stdin, its stdout back. The call's
  end (the driver gone, cancelled, or its stream closed) ends the process; the process's
  end ends the call, with ``UNAVAILABLE`` naming its exit code or signal unless it exited
  cleanly. The daemon never parses a frame and holds no JAX state for the slice.
* :class:`RemoteMember` (the driver): a member reached that way, with the interface
  :class:`~rallypoint.workers.gang.group.SliceGroup` drives (``send``, ``receive``, ``kill``,
  ``stop``); a broken call or a silent one past the request's deadline is a
  :class:`~rallypoint.workers.gang.group.GroupLost` naming the member.
* :func:`form_on_workers`: a group of members on the given workers, member 0 first (its
  daemon picks the coordinator's port), then the others, joined.
* :class:`MemberPool` (the daemon, ``--member-pool N``): member processes started ahead of
  need, their imports done, so that forming a group (a recovery's, most of all) does not wait
  for each member's Python and JAX to load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from rallypoint.basics.errors import StoreError
from rallypoint.basics.logs import get_logger
from rallypoint.proto import rallypoint_pb2 as pb, rallypoint_pb2_grpc as pb_grpc
from rallypoint.workers.gang.member import MAX_HEADER, encode_frame, frame_header, write_frame
from rallypoint.workers.gang.member_bounds import MemberRefused
from rallypoint.workers.gang.group import (HEARTBEAT_S, INIT_TIMEOUT_S, POOLED_ARGV, REQUEST_TIMEOUT_S, GroupLost,
                                            MemberSettings, SliceGroup, free_port)

CHUNK = 1 << 20  # bytes per message: under gRPC's 4 MiB default, whatever a value's size
SETTINGS = {"processes": int, "process": int, "local_devices": int, "platform": str, "init_timeout_s": int,
            "heartbeat_s": int, "coordinator": str, "device_ids": list, "job": str, "slice": str}
STOP_WAIT_S = 5.0
START_TIMEOUT_S = 30.0  # a Member call's first answer (the process started): a worker hung or with every server
# thread busy gives none, and the formation fails naming it instead of waiting for ever
REFILL_S = 10.0  # how long after a job's warm member was taken the pool starts another


def member_settings(start: str, host: str, platform: str = "cpu", tls: Sequence[str] = (),
                    compile_cache: str = "") -> MemberSettings:
    """The settings a driver sent, checked, completed with this worker's ``host``, its ``tls`` paths and
    ``compile_cache`` (which a driver cannot set) and (unless the driver named one) its ``platform``."""
    try:
        given = json.loads(start or "{}")
    except (json.JSONDecodeError, RecursionError) as exc:
        raise MemberRefused(f"the member's settings are not JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(given, dict):
        raise MemberRefused("the member's settings must be a JSON object")
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        raise MemberRefused(f"unknown member settings {unknown}; known: {sorted(SETTINGS)}")
    missing = sorted({"processes", "process", "local_devices"} - set(given))
    if missing:
        raise MemberRefused(f"member settings {missing} are missing")
    for k, kind in SETTINGS.items():
        if k in given and not isinstance(given[k], kind):
            raise MemberRefused(f"member setting {k!r} must be {kind.__name__}, got {given[k]!r}")
    if not 0 <= given["process"] < given["processes"]:
        raise MemberRefused(f"member {given['process']} of a group of {given['processes']}")
    if given["local_devices"] < 1:
        raise MemberRefused("a member needs at least one local device")
    ids = given.get("device_ids", [])
    if ids and (not all(isinstance(i, int) and i >= 0 for i in ids) or len(set(ids)) != len(ids)
                or len(ids) != given["local_devices"]):
        raise MemberRefused(f"member setting 'device_ids' must list {given['local_devices']} distinct device "
                            f"indices of this worker (its leased devices), got {ids!r}")
    coordinator = given.get("coordinator") or ""
    if not coordinator:
        if given["process"] != 0:
            raise MemberRefused("members other than 0 must be told the group's coordinator (member 0 names it)")
        coordinator = f"{host}:{free_port(host)}"
    return MemberSettings(coordinator, given["processes"], given["process"], given["local_devices"],
                          given.get("platform") or platform, given.get("init_timeout_s", INIT_TIMEOUT_S),
                          given.get("heartbeat_s", HEARTBEAT_S), host, tuple(ids), tuple(str(p) for p in tls),
                          compile_cache)


class MemberPool:
    """Member processes started ahead of need, ``size`` idle per platform, each with JAX and Orbax imported and
    waiting for its settings (``group_member --pooled``): most of a member's start is done before a group forms.

    :meth:`take` hands one over with its settings (or starts one the usual way when none is idle) and starts the
    next in its place. An idle member costs its memory (191 MB resident with JAX imported on CPU) and dies with its
    daemon (``PR_SET_PDEATHSIG``) or when :meth:`close` closes its stdin. ``size`` 0: no pool.
    """

    def __init__(self, size: int = 0) -> None:
        self.size = max(0, size)
        self._idle: dict[str, list[subprocess.Popen[bytes]]] = {}
        self._held: dict[str, int] = {}  # job -> members its warm-spare plan asks this worker to keep started
        self._lock = threading.Lock()
        self._closed = False

    @property
    def target(self) -> int:
        """Idle members kept per platform: ``size``, and those the warm-spare plans of jobs ask for."""
        return self.size + sum(self._held.values())

    def fill(self, platform: str) -> None:
        """Start members for ``platform`` until :attr:`target` are idle."""
        with self._lock:
            idle = [p for p in self._idle.get(platform, []) if p.poll() is None]
            while not self._closed and len(idle) < self.target:
                idle.append(subprocess.Popen(POOLED_ARGV, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
                get_logger("rallypoint.member").info("member.pooled", pid=idle[-1].pid, platform=platform)
            self._idle[platform] = idle

    def hold(self, job: str, members: int, platform: str) -> None:
        """Keep ``members`` started for ``job`` (a warm spare of its multi-host slices; 0: no more), beside
        ``size``: started now, or ended when no longer asked for."""
        with self._lock:
            if members > 0:
                self._held[job] = members
            else:
                self._held.pop(job, None)
            idle = [p for p in self._idle.get(platform, []) if p.poll() is None]
            surplus, self._idle[platform] = idle[self.target:], idle[:self.target]
        _end_idle(surplus)
        self.fill(platform)

    def take(self, settings: MemberSettings) -> tuple[subprocess.Popen[bytes], bool]:
        """A member process for ``settings``, started: an idle one told them, or a new one; whether it was idle."""
        with self._lock:
            idle = self._idle.get(settings.platform, [])
            proc = next((p for p in idle if p.poll() is None), None)
            self._idle[settings.platform] = [p for p in idle if p is not proc and p.poll() is None]
        if proc is not None:
            try:
                assert proc.stdin is not None
                write_frame(proc.stdin, {"settings": settings.to_json()})
            except (OSError, ValueError):
                proc.kill()
                proc.wait()
                proc = None
        if self._held:  # a job's warm member was taken, by a recovery most likely: started again once it is over,
            timer = threading.Timer(REFILL_S, self.fill, (settings.platform,))  # not competing with it for the CPU
            timer.daemon = True
            timer.start()
        elif self.size:
            self.fill(settings.platform)
        if proc is None:
            return subprocess.Popen(settings.argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE), False
        return proc, True

    def close(self) -> None:
        """End the idle members (their stdin closed: each exits unused)."""
        with self._lock:
            self._closed = True
            idle = [p for ps in self._idle.values() for p in ps]
            self._idle.clear()
        _end_idle(idle)


def _end_idle(idle: Sequence[subprocess.Popen[bytes]]) -> None:
    """End idle pooled members: their stdin closed, each exits unused (killed if it does not)."""
    for p in idle:
        try:
            assert p.stdin is not None
            p.stdin.close()
        except OSError:
            pass
    for p in idle:
        try:
            p.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


Bind = Callable[[str, str, Sequence[int]], Sequence[str]]
"""A worker's check of a ``Member`` call's job, slice and device indices against its device leases: the job's
checkpoint folders (MemberRefused: the leader leased no such devices here)."""


def relay(requests: Iterator[pb.MemberChunk], context: grpc.ServicerContext, *, host: str, worker: str,
          platform: str = "cpu", pool: MemberPool | None = None, tls: Sequence[str] = (),
          compile_cache: str = "", bind: Bind | None = None) -> Iterator[pb.MemberChunk]:
    """The daemon's side of one ``Member`` call (see the module doc); the caller checked ``to``. ``tls``: the
    worker's CA, certificate and key paths, with which the member pushes its shards' copies (workers/gang/replicas.py).
    ``bind``: the member starts only for devices the leader leased here to the job and slice it names, and is
    bound to that job (:mod:`rallypoint.workers.gang.member_bounds`); None: unbound (a worker without a store)."""
    first = next(requests, None)
    if first is None:
        return
    try:
        settings = member_settings(first.start, host, platform, tls, compile_cache)
    except MemberRefused as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return
    if bind is not None:
        given = json.loads(first.start)
        job, slice_name = str(given.get("job", "")), str(given.get("slice", ""))
        try:
            dirs = bind(job, slice_name, settings.device_ids)
        except MemberRefused as exc:
            get_logger("rallypoint.member", worker=worker).warning("member.refused", job=job, slice=slice_name,
                                                                   devices=list(settings.device_ids), error=str(exc))
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            return
        except StoreError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {worker} cannot read its device leases: {exc}")
            return
        settings = dataclasses.replace(settings, job=job, slice=slice_name, dirs=tuple(dirs))
    log = get_logger("rallypoint.member", worker=worker, process=settings.process)
    proc, pooled = (pool or MemberPool()).take(settings)
    ended = threading.Event()

    def end() -> None:  # the call is over, however it ended: the member goes with it
        ended.set()
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    context.add_callback(end)
    log.info("member.started", pid=proc.pid, coordinator=settings.coordinator, processes=settings.processes,
             pooled=pooled)

    def feed() -> None:
        assert proc.stdin is not None
        try:
            for chunk in requests:
                proc.stdin.write(chunk.data)
                proc.stdin.flush()
            proc.stdin.close()  # the driver closed its side: the member ends when it has read everything
        except (OSError, ValueError, grpc.RpcError):
            end()

    threading.Thread(target=feed, name=f"member-{settings.process}-in", daemon=True).start()
    yield pb.MemberChunk(start=json.dumps({"pid": proc.pid, "coordinator": settings.coordinator}))
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ended.is_set():
            return
        if not ready:
            continue
        data = os.read(fd, CHUNK)
        if not data:
            break
        yield pb.MemberChunk(data=data)
    code = proc.wait()
    log.info("member.ended", pid=proc.pid, code=code)
    if code != 0:
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        context.abort(grpc.StatusCode.UNAVAILABLE, f"member {settings.process} on worker {worker} {why}")


class FrameParser:
    """Protocol frames (:func:`rallypoint.workers.gang.member.read_frame`'s format) from chunks of bytes."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], list[bytes]]]:
        """The frames ``data`` completes, in order.

        Raises:
            ValueError: a header line past ``MAX_HEADER`` bytes, or one :func:`frame_header` refuses; the
                stream is then not a member's (nothing after it can be read).
        """
        self._buf += data
        frames = []
        while True:
            end = self._buf.find(b"\n", 0, MAX_HEADER + 1)
            if end < 0:
                if len(self._buf) > MAX_HEADER:
                    raise ValueError(f"a frame's header line runs past {MAX_HEADER} bytes: the stream is not a member's")
                return frames
            header, sizes = frame_header(self._buf[:end])
            need = end + 1 + sum(sizes)
            if len(self._buf) < need:
                return frames
            payloads, at = [], end + 1
            for n in sizes:
                payloads.append(bytes(self._buf[at:at + n]))
                at += n
            del self._buf[:need]
            frames.append((header, payloads))


class RemoteMember:
    """A member process on another worker, reached through that worker's ``Member`` call."""

    def __init__(self, stub: pb_grpc.WorkerRuntimeStub, to: pb.Identity, settings: dict[str, Any], *,
                 timeout_s: float = INIT_TIMEOUT_S + 30.0, start_timeout_s: float = START_TIMEOUT_S,
                 cancel: threading.Event | None = None) -> None:
        self.index = int(settings["process"])
        self.worker = to.worker_id
        self.ready: dict[str, Any] = {}
        self._requests: queue.Queue[pb.MemberChunk | None] = queue.Queue()
        self._frames: queue.Queue[tuple[dict[str, Any], list[bytes]] | None] = queue.Queue()
        self._ended = ""
        self._requests.put(pb.MemberChunk(to=to, start=json.dumps(settings)))
        self._call = stub.Member(iter(self._requests.get, None))
        started, gave_up = threading.Event(), []

        def deadline() -> None:  # no first answer in time, or an unload of the job: the call is cancelled
            end = time.monotonic() + start_timeout_s
            while not started.wait(0.1):
                if (cancel is not None and cancel.is_set()) or time.monotonic() >= end:
                    gave_up.append("the load was cancelled" if cancel is not None and cancel.is_set() else
                                   f"no answer within {start_timeout_s:.0f} s (its worker hung, or every thread of "
                                   "its server busy)")
                    self._call.cancel()
                    return

        threading.Thread(target=deadline, name=f"member-{self.index}-start", daemon=True).start()
        try:
            first = next(self._call)
        except grpc.RpcError as exc:
            self._requests.put(None)
            why = gave_up[0] if gave_up else exc.details()
            raise GroupLost(self.index, f"worker {self.worker} did not start it: {why}", worker=self.worker) from None
        finally:
            started.set()
        try:
            start = json.loads(first.start)
            self.pid, self.coordinator = int(start["pid"]), str(start["coordinator"])
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            self._call.cancel()
            raise GroupLost(self.index, f"worker {self.worker} answered garbage to its start ({type(exc).__name__})",
                            worker=self.worker) from None
        self._reader = threading.Thread(target=self._read, name=f"member-{self.index}-out", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        parser = FrameParser()
        try:
            for chunk in self._call:
                for frame in parser.feed(chunk.data):
                    self._frames.put(frame)
            self._ended = "its call ended"
        except grpc.RpcError as exc:
            self._ended = exc.details() or str(exc.code())
        except ValueError as exc:  # its worker sent what is not the protocol: the member is lost, this thread ends
            self._ended = f"it answered garbage ({exc})"
            self._call.cancel()
        self._frames.put(None)

    def send(self, header: dict[str, Any], payloads: Sequence[Any] = ()) -> None:
        if self._ended:
            raise GroupLost(self.index, f"on worker {self.worker}: {self._ended}", worker=self.worker)

        data = b"".join(encode_frame(header, payloads))
        for i in range(0, len(data), CHUNK):
            self._requests.put(pb.MemberChunk(data=data[i:i + CHUNK]))

    def receive(self, deadline: float, what: str) -> tuple[dict[str, Any], list[bytes]]:
        left = deadline - time.monotonic()
        try:
            frame = self._frames.get(timeout=max(left, 0.0))
        except queue.Empty:
            raise GroupLost(self.index, f"on worker {self.worker}: no answer to {what} within {max(left, 0):.0f} s "
                                        "(hung or partitioned)", worker=self.worker) from None
        if frame is None:
            self._frames.put(None)
            raise GroupLost(self.index, f"on worker {self.worker}: {self._ended}", worker=self.worker)
        return frame

    def kill(self) -> None:
        """End the call: the member's worker kills the process."""
        self._call.cancel()
        self._reader.join(STOP_WAIT_S)

    def stop(self) -> None:
        """Close the driver's side; the member ends when it has read everything (else the call is cancelled)."""
        self._requests.put(None)
        self._reader.join(STOP_WAIT_S)
        if self._reader.is_alive():
            self.kill()


def form_on_workers(workers: Sequence[tuple[pb_grpc.WorkerRuntimeStub, pb.Identity]], local_devices: int, *,
                    platform: str = "", init_timeout_s: int = INIT_TIMEOUT_S, heartbeat_s: int = HEARTBEAT_S,
                    request_timeout_s: float = REQUEST_TIMEOUT_S,
                    device_ids: Sequence[Sequence[int]] = (), job: str = "", slice_name: str = "",
                    cancel: threading.Event | None = None) -> SliceGroup:
    """A slice's group with member ``i`` on ``workers[i]``, formed and joined (GroupLost naming one that failed).
    ``platform`` "": each member uses its worker's (the gang is of one platform: ``choose_gang``).
    ``device_ids[i]``: the device indices leased on ``workers[i]``, the only ones its member uses, to ``job``'s
    slice ``slice_name``: each worker checks its leases name them before it starts the member. ``cancel`` set (an
    unload of the job): the formation ends at once, a GroupLost."""
    t0 = time.monotonic()
    base = {"processes": len(workers), "local_devices": local_devices, "init_timeout_s": init_timeout_s,
            "heartbeat_s": heartbeat_s, **({"platform": platform} if platform else {}),
            **({"job": job, "slice": slice_name} if job else {})}
    group = SliceGroup([], request_timeout_s=request_timeout_s)
    formed = threading.Event()
    if cancel is not None:  # an unload while the members join: every member's call ends, the join fails at once
        threading.Thread(target=_abort_when, args=(cancel, formed, group), name="gang-cancel", daemon=True).start()
    try:
        for i, (stub, to) in enumerate(workers):
            coordinator = group.members[0].coordinator if group.members else ""
            mine = {"device_ids": [int(d) for d in device_ids[i]]} if device_ids else {}
            group.members.append(RemoteMember(stub, to, {**base, "process": i, "coordinator": coordinator, **mine},
                                              cancel=cancel))
        group.join(init_timeout_s + 30.0, since=t0)
    except BaseException:
        formed.set()
        group.abort()
        raise
    formed.set()
    return group


def _abort_when(cancel: threading.Event, formed: threading.Event, group: SliceGroup) -> None:
    while not formed.is_set():
        if cancel.wait(0.2):
            if not formed.is_set():
                group.abort()
            return
