"""A multi-host slice's JAX distributed group: its member processes, formed, driven and lost as one.

A slice larger than one worker runs on several workers as one gang (docs/multihost.md).
Each member worker's daemon starts one member process
(:mod:`rallypoint.workers.gang.member`) and supervises it; the members join one JAX
distributed group (each group its own coordinator address, process ids in the gang's
fixed order, an initialization timeout that fits a recovery rather than JAX's 300 s, and
gloo for CPU collectives) and run the slice's exported programs over its global mesh.

:class:`SliceGroup` drives the members in lockstep: every request goes to every member
before any answer is read, because each member blocks in the program's collectives until
all have entered it. Values go in and out **shard by shard**: each member is sent only
the shards it holds and answers with only those (:meth:`SliceGroup.put`,
:meth:`SliceGroup.shards`); nothing gathers the whole value on a member.

Losing any member loses the group. A member that exits, is killed, or does not answer
within the request's deadline (hung, partitioned) raises :class:`GroupLost` naming it;
:meth:`SliceGroup.abort` then stops every survivor by its pid, at once. Left alone, JAX's
coordination service would abort them itself (SIGABRT) after the heartbeat timeout, and
a survivor inside a collective would wait until then: the abort is part of the recovery,
not a second failure (``../shared/notes/multihost-cpu.md``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from rallypoint.basics.errors import RallypointError
from rallypoint.workers.gang.member import read_frame, write_frame

INIT_TIMEOUT_S = 30
"""How long a member waits for the others to join (JAX's default is 300 s: a recovery cannot wait that long)."""
HEARTBEAT_S = 10
"""JAX's coordination-service heartbeat timeout: the bound on a survivor nobody stopped."""
REQUEST_TIMEOUT_S = 120.0
"""A request not answered within this is a lost member (hung or partitioned)."""
STOP_WAIT_S = 5.0


class GroupError(RallypointError):
    """A member refused a request (a bad program or value): the user's error, the group stays."""


class GroupLost(RallypointError):
    """A member of the group died, hung or could not join: the slice is lost as a unit."""

    def __init__(self, member: int, reason: str, *, worker: str = "") -> None:
        super().__init__(f"member {member} of the slice's group is lost: {reason}")
        self.member, self.reason = member, reason
        self.worker = worker  # the worker the member ran on; empty: the lead's own


POOLED_ARGV = [sys.executable, "-m", "rallypoint.workers.gang.member", "--pooled"]
"""A member process started ahead of need (its settings come as its first frame)."""


@dataclass(frozen=True, slots=True)
class MemberSettings:
    """What one member process needs to join its group."""

    coordinator: str  # host:port of the group's JAX coordination service (member 0 serves it)
    processes: int
    process: int
    local_devices: int
    platform: str = "cpu"
    init_timeout_s: int = INIT_TIMEOUT_S
    heartbeat_s: int = HEARTBEAT_S
    address: str = ""  # this member's host address, where its collectives listen ("": the host name's)
    device_ids: tuple[int, ...] = ()  # the worker's devices it uses (its leased ones); (): the first local_devices
    tls: tuple[str, ...] = ()  # its worker's CA, certificate and key paths (the daemon's): pushes of its shards
    compile_cache: str = ""  # its worker's persistent compilation cache ("": none): a gang formed again loads its
    # programs' executables instead of compiling them
    job: str = ""  # the job and slice its worker's device leases name (""; unbound: a group formed in one process)
    slice: str = ""
    dirs: tuple[str, ...] = ()  # the job's checkpoint folders, the only ones it saves to and restores from

    def to_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v := getattr(self, k), tuple) else v) for k in self.__dataclass_fields__}

    def argv(self) -> list[str]:
        return [*POOLED_ARGV[:-1], json.dumps(self.to_json())]


def _contiguous(a: np.ndarray) -> np.ndarray:
    """``a`` in C order (np.ascontiguousarray would make a 0-d array 1-d: a step number is 0-d)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the group's coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class MemberProcess:
    """One member process, started and supervised by its worker's daemon."""

    def __init__(self, settings: MemberSettings, *, env: dict[str, str] | None = None,
                 stderr: Any = None, prefix: Sequence[str] = ()) -> None:
        self.settings = settings
        self.index = settings.process
        self.worker = ""  # on this worker
        self._proc = subprocess.Popen([*prefix, *settings.argv()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=stderr, env=dict(os.environ if env is None else env))
        self.pid = self._proc.pid
        self.ready: dict[str, Any] = {}

    # -- the protocol -------------------------------------------------------------------

    def send(self, header: dict[str, Any], payloads: Sequence[Any] = ()) -> None:
        assert self._proc.stdin is not None
        try:
            write_frame(self._proc.stdin, header, list(payloads))
        except (OSError, ValueError) as exc:
            raise GroupLost(self.index, self._ended() or f"its pipe broke ({exc})") from None

    def receive(self, deadline: float, what: str) -> tuple[dict[str, Any], list[bytes]]:
        assert self._proc.stdout is not None
        left = deadline - time.monotonic()
        ready, _, _ = select.select([self._proc.stdout], [], [], max(left, 0.0))
        if not ready:
            raise GroupLost(self.index, f"no answer to {what} within {left + (time.monotonic() - deadline):.0f} s "
                                        "(hung or partitioned)")
        try:
            frame = read_frame(self._proc.stdout)
        except ValueError as exc:  # what it wrote is not the protocol
            raise GroupLost(self.index, f"it answered garbage ({exc})") from None
        if frame is None:
            raise GroupLost(self.index, self._ended() or "its pipe closed")
        return frame

    def _ended(self) -> str:
        try:
            code = self._proc.wait(1.0)
        except subprocess.TimeoutExpired:
            return ""
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    # -- its life -----------------------------------------------------------------------

    def alive(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL by its pid (a stopped process dies too) and reap it."""
        if self._proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._proc.wait()
        self._close_pipes()

    def stop(self) -> None:
        """End it cleanly if it answers (stdin closed), else kill it."""
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self._proc.stdin, self._proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


class Member(Protocol):
    """What :class:`SliceGroup` drives: a member process here (:class:`MemberProcess`) or on another worker
    (:class:`rallypoint.workers.gang.link.RemoteMember`)."""

    index: int
    worker: str  # the worker it runs on; empty: this one
    pid: int
    ready: dict[str, Any]

    def send(self, header: dict[str, Any], payloads: Sequence[Any] = ()) -> None: ...
    def receive(self, deadline: float, what: str) -> tuple[dict[str, Any], list[bytes]]: ...
    def kill(self) -> None: ...
    def stop(self) -> None: ...


class SliceGroup:
    """The members of one slice's group, driven in lockstep (member ``i`` is process ``i``)."""

    def __init__(self, members: Sequence[Member], *, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.members: list[Member] = list(members)
        self.request_timeout_s = request_timeout_s
        self._where: dict[str, list[list[Any]]] = {}
        self._lock = threading.RLock()  # one request at a time: every member must see them in the same order
        self._free: list[str] = []  # values let go of, dropped on the members with the next request
        self.formed_s = 0.0

    @classmethod
    def form(cls, processes: int, local_devices: int, *, host: str = "127.0.0.1", port: int = 0,
             platform: str = "cpu", init_timeout_s: int = INIT_TIMEOUT_S, heartbeat_s: int = HEARTBEAT_S,
             request_timeout_s: float = REQUEST_TIMEOUT_S, stderr: Any = None,
             prefixes: Sequence[Sequence[str]] | None = None, addresses: Sequence[str] | None = None) -> SliceGroup:
        """Start ``processes`` members from here and wait until they have joined.

        ``host`` is member 0's address, where the group's coordinator listens (``port``, or one free here);
        ``prefixes[i]`` runs member ``i`` elsewhere (``ip netns exec NS``: another host's network), whose
        address is ``addresses[i]`` (else ``host``).
        On a cluster each member worker's daemon starts its own member the same way."""
        t0 = time.monotonic()
        coordinator = f"{host}:{port or free_port(host)}"
        members = [MemberProcess(MemberSettings(coordinator, processes, i, local_devices, platform, init_timeout_s,
                                                heartbeat_s, addresses[i] if addresses is not None else host),
                                 stderr=stderr,
                                 prefix=prefixes[i] if prefixes is not None else ()) for i in range(processes)]
        group = cls(members, request_timeout_s=request_timeout_s)
        group.join(init_timeout_s + 30.0, since=t0)
        return group

    def join(self, timeout_s: float, *, since: float) -> None:
        """Wait for every member's ``ready``; ``formed_s`` counts from ``since``. A member that failed to join
        raises :class:`GroupLost` naming it, and every member is stopped first."""
        deadline = time.monotonic() + timeout_s
        try:
            for m in self.members:
                header, _ = m.receive(deadline, "joining the group")
                if not header.get("ready"):
                    raise GroupLost(m.index, "it could not join the group:\n" + str(header.get("error", "")),
                                    worker=m.worker)
                m.ready = header
        except BaseException:
            self.abort()
            raise
        self.formed_s = time.monotonic() - since

    # -- requests -----------------------------------------------------------------------

    def request(self, header: dict[str, Any], payloads: Sequence[Sequence[Any]] | None = None,
                timeout_s: float | None = None, *, extra: Sequence[dict[str, Any]] | None = None,
                ) -> list[tuple[dict[str, Any], list[bytes]]]:
        """Send ``header`` (with member ``i``'s ``extra[i]`` fields and ``payloads[i]``) to every member, then read
        every answer: each member blocks in the program's collectives until all have entered it."""
        with self._lock:
            if self._free:
                header, self._free = dict(header, free=self._free), []
            for i, m in enumerate(self.members):
                m.send(dict(header, **(extra[i] if extra is not None else {})),
                       payloads[i] if payloads is not None else ())
            deadline = time.monotonic() + (self.request_timeout_s if timeout_s is None else timeout_s)
            answers = [m.receive(deadline, f"{header['op']!r}") for m in self.members]
        errors = [(m.index, h["error"]) for m, (h, _) in zip(self.members, answers, strict=True) if "error" in h]
        if errors:
            what = f"value {header['value']!r}" if "value" in header else repr(header["op"])
            raise GroupError(f"the slice's group refused {what}: member {errors[0][0]}: {errors[0][1]}")
        return answers

    def release(self, value: str) -> None:
        """``value`` is no longer needed: the members drop it with the next request (any thread)."""
        self._free.append(value)

    def mesh(self, name: str, shape: Sequence[int], axes: Sequence[str]) -> None:
        self.request({"op": "mesh", "name": name, "shape": list(shape), "axes": list(axes)})

    def load(self, prog: str, exported: bytes, mesh: str) -> tuple[int, int]:
        """Load an exported program on every member for ``mesh``; how many arguments it takes and gives."""
        h, _ = self.request({"op": "load", "prog": prog, "mesh": mesh}, [[exported]] * len(self.members))[0]
        return int(h["ins"]), int(h["outs"])

    def where(self, layout: dict[str, Any], shape: Sequence[int], value: str = "") -> list[list[list[list[int]]]]:
        """Per member, the indices (``[[start, stop], ...]``) of the shards it holds of a value of ``shape``
        laid out as ``layout`` says (``{"mesh", "spec"}``, or ``{"prog", "arg"}``: as a loaded program takes
        that argument, ``{"prog", "out"}``: as it gives that output); ``value`` names it in errors."""
        key = json.dumps([layout, list(shape)], sort_keys=True)
        if key not in self._where:
            answers = self.request({"op": "where", **layout, "shape": list(shape), **({"value": value} if value else {})})
            self._where[key] = [h["shards"] for h, _ in answers]
        return self._where[key]

    def put(self, value: str, array: np.ndarray, mesh: str, spec: Sequence[Any]) -> list[int]:
        """Make ``value`` on the group from a host array on ``mesh`` laid out as ``spec``; see :meth:`put_as`."""
        return self.put_as(value, array, {"mesh": mesh, "spec": list(spec)})

    def put_as(self, value: str, array: Any, layout: dict[str, Any]) -> list[int]:
        """Make ``value`` on the group from a host array, each member sent only its shards; the bytes each got."""
        a = _contiguous(np.asarray(array))
        held = self.where(layout, a.shape, value)
        payloads = [[_contiguous(a[tuple(slice(x, y) for x, y in ix)]) for ix in shards] for shards in held]
        answers = self.request({"op": "put", "value": value, **layout, "shape": list(a.shape), "dtype": a.dtype.str},
                               payloads, extra=[{"shards": shards} for shards in held])
        return [int(h["bytes"]) for h, _ in answers]

    def call(self, prog: str, args: Sequence[str | None], outs: Sequence[str], *,
             host: Mapping[int, np.ndarray] | None = None,
             ) -> tuple[list[tuple[str, tuple[int, ...]]], dict[int, np.ndarray]]:
        """Run a loaded program on every member, in one request; the outputs stay on the group.

        ``host``: argument index -> a small host array sent whole in the request (its ``args`` entry None), which
        each member lays out as the program takes it. Returns the outputs' dtypes and shapes, and the value of
        each scalar output by index (each member holds all of one: the first member's is sent back).
        """
        host = dict(host or {})
        given = [_contiguous(host[i]) for i in sorted(host)]
        header = {"op": "call", "prog": prog, "args": list(args), "outs": list(outs), "scalars": True,
                  "host": [{"arg": i, "dtype": a.dtype.str, "shape": list(a.shape)}
                           for i, a in zip(sorted(host), given, strict=True)]}
        h, data = self.request(header, [given] * len(self.members) if given else None)[0]
        avals = [(d, tuple(s)) for d, s in h["avals"]]
        scalars = {int(i): np.frombuffer(b, dtype=np.dtype(avals[int(i)][0])).reshape(()).copy()
                   for i, b in zip(h.get("scalars", ()), data, strict=True)}
        return avals, scalars

    def shards(self, value: str) -> tuple[list[list[tuple[list[list[int]], np.ndarray]]], np.dtype, tuple[int, ...]]:
        """Per member, the shards of ``value`` it holds (each index once) as host arrays; its dtype and shape."""
        out = []
        answers = self.request({"op": "get", "value": value})
        dtype, shape = np.dtype(answers[0][0]["dtype"]), tuple(answers[0][0]["shape"])
        for h, data in answers:
            out.append([(ix, np.frombuffer(b, dtype=dtype).reshape([y - x for x, y in ix]))
                        for ix, b in zip(h["shards"], data, strict=True)])
        return out, dtype, shape

    def fetch(self, value: str) -> np.ndarray:
        """``value`` assembled on this side from the members' shards: what a slice's value gathered on its lead is
        (a metric, a push to another slice, a checkpoint, the final state; docs/multihost.md)."""
        parts, dtype, shape = self.shards(value)
        out = np.empty(shape, dtype=dtype)
        for member in parts:
            for ix, a in member:
                out[tuple(slice(x, y) for x, y in ix)] = a
        return out

    def save(self, directory: str, tree: Mapping[str, Sequence[str]], *, wait: bool = True,
             keep: bool = False) -> list[list[Any]]:
        """An Orbax multi-process checkpoint of ``{state: [value names]}`` in ``directory``, each member writing
        its own shards. The digest of every shard, each once (``[state, leaf, index, dtype, shape, sha256]``).
        ``wait`` False: returns once the members hold their host copies; :meth:`saved` waits for the writing.
        ``keep``: each member also keeps a host copy of its shards for the in-memory tier (``stash``)."""
        answers = self.request({"op": "save", "dir": directory, "tree": {k: list(v) for k, v in tree.items()},
                                "wait": wait, "keep": keep})
        return [e for h, _ in answers for e in h["shards"]]

    def saved(self, directory: str, *, wait: bool = True) -> bool:
        """Whether every member has written its part of the save into ``directory`` (``save(wait=False)``);
        ``wait``: until they have (the group waits meanwhile), else a quick look."""
        return all(h["done"] for h, _ in self.request({"op": "saved", "dir": directory, "wait": wait}))

    def restore(self, directory: str, tree: Mapping[str, Sequence[dict[str, Any]]]) -> list[list[Any]]:
        """Read ``{state: [leaf]}`` back from an Orbax checkpoint, each leaf ``{value, shape, dtype}`` (the name it
        gets) and its layout (``put_as``'s), each member reading its own shards. The digests, as :meth:`save`'s."""
        answers = self.request({"op": "restore", "dir": directory, "tree": {k: list(v) for k, v in tree.items()}})
        return [e for h, _ in answers for e in h["shards"]]

    def free(self, values: Sequence[str]) -> None:
        self.request({"op": "free", "values": list(values)})

    # -- its end ------------------------------------------------------------------------

    def pids(self) -> list[int]:
        return [m.pid for m in self.members]

    def abort(self) -> None:
        """The group is lost: stop every member that is left, by its pid, now."""
        for m in self.members:
            m.kill()

    def close(self) -> None:
        """End the group cleanly (every member leaves together), or abort it."""
        try:
            for m in self.members:
                m.send({"op": "exit"})
            deadline = time.monotonic() + STOP_WAIT_S
            for m in self.members:
                m.receive(deadline, "'exit'")
        except GroupLost:
            self.abort()
            return
        for m in self.members:
            m.stop()
