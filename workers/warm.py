"""Warm spares, the worker's side: executables compiled before any loss, and each node's first call.

A spare asked to warm a job (``WarmJob``, docs/recovery.md) compiles the exported
programs of the slices it could take over, on the devices a recovery would lease it,
and keeps the executables in a :class:`WarmCache` keyed by job, node, the program's
digest and the device assignment (devices, mesh shape, mesh axes). A later
``LoadJob`` of that job takes the entries that match what it loads; a node's
:class:`NodeExecutable` then runs the warm executable from its first call, instead of
compiling there. Any mismatch (other devices, another program) is a miss: the node
compiles at its first call, as without warming, and says so.

Warming is best effort. A compile runs on its own thread at a lower CPU priority; one
that fails is logged and reported, and the node compiles at its first call. A load
that arrives while a warm compile of its node still runs waits for that compile (it
would take as long again). The cache is bounded (``max_programs``); a job's entries go
when the job is loaded here (this worker is no spare of it any more), when a job
takes the devices they were compiled for, when the coordinator sends an empty
request (the spare is no longer in the plan, or the job ended) and when the job
finishes here.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.programs import check_exported_platform, slice_mesh

DEFAULT_MAX_PROGRAMS = 256  # executables one worker keeps warm, for all jobs together
WARM_NICE = 10  # how much lower the CPU priority of a warm compile is than the worker's
WAIT_WARM_S = 600.0  # a first call waits this long, at most, for a warm compile still running

WarmKey = tuple[str, str, str, tuple[int, ...], tuple[int, ...], tuple[str, ...]]


def program_key(job: str, node: pb.NodeProgram, sa: pb.SliceAssignment) -> WarmKey:
    """What an executable is compiled for: job, node, program digest, devices, mesh shape and axes."""
    return (job, node.name, hashlib.sha256(node.exported).hexdigest(), tuple(sa.devices), tuple(sa.mesh_shape),
            tuple(sa.mesh_axes))


def compile_exported(exp: Any, mesh: Any) -> Any:
    """Compile a deserialized exported program for ``mesh`` ahead of its call (a ``jax.stages.Compiled``)."""
    import jax

    jitted = jax.jit(exp.call, in_shardings=exp.in_shardings_jax(mesh), out_shardings=exp.out_shardings_jax(mesh))
    return jitted.lower(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exp.in_avals]).compile()


def arg_shardings(shardings: Iterable[Any], mesh: Any) -> list[Any]:
    """An exported program's shardings on ``mesh``, an unspecified one (None) as replicated on the mesh."""
    import jax

    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return [whole if s is None else s for s in shardings]


def _deserialize(blob: bytes) -> Any:
    import jax

    return jax.export.deserialize(bytearray(blob))


@dataclass
class WarmEntry:
    """One executable compiled (or being compiled) ahead of a load."""

    done: threading.Event = field(default_factory=threading.Event)
    compiled: Any = None
    error: str = ""
    compile_s: float = 0.0


class NodeExecutable:
    """A node's program on its slice's mesh, compiled at most once: ahead (``warm``) or at its first call.

    After the first call, ``source`` says where the executable came from (``"warm"`` or
    ``"compiled"``) and ``compile_s`` how long that call spent getting it (0 for a warm
    executable that was ready; the wait, for one still compiling).
    """

    def __init__(self, blob: bytes, mesh: Any, warm: WarmEntry | None = None) -> None:
        self._exp = _deserialize(blob)  # a bad program fails the load, not the first call
        check_exported_platform(self._exp, mesh)  # so does one lowered for another platform
        self._mesh, self._warm = mesh, warm
        # where each flat argument must be when the program is called (the runtime puts it there)
        self.in_shardings = tuple(arg_shardings(self._exp.in_shardings_jax(mesh), mesh))
        self._compiled: Any = None
        self.source, self.compile_s = "", 0.0
        self._reported = False

    @property
    def mesh(self) -> Any:
        """The slice's mesh the program runs on."""
        return self._mesh

    @property
    def exported(self) -> Any:
        """The deserialized ``jax.export.Exported``."""
        return self._exp

    @property
    def expected(self) -> str:
        """What the load found: ``"warm"`` (an executable held, or compiling) or ``"cold"``."""
        return "warm" if self._warm is not None else "cold"

    def __call__(self, *args: Any) -> Any:
        if self._compiled is None:
            self._first()
        return self._compiled(*args)

    def _first(self) -> None:
        t0 = time.perf_counter()
        ready = self._warm is not None and self._warm.done.is_set()
        if self._warm is not None and self._warm.done.wait(WAIT_WARM_S) and self._warm.compiled is not None:
            self._compiled, self.source = self._warm.compiled, "warm"
        else:
            self._compiled, self.source = compile_exported(self._exp, self._mesh), "compiled"
        # A warm executable that was ready cost this call nothing; a wait for one still compiling counts.
        self.compile_s = 0.0 if ready and self.source == "warm" else time.perf_counter() - t0
        self._warm = None

    def first_report(self) -> tuple[str, float] | None:
        """``(source, compile_s)`` once, after the first call; None before it and after the first report."""
        if self._reported or not self.source:
            return None
        self._reported = True
        return self.source, self.compile_s


class WarmCache:
    """The executables this worker holds for jobs it might take over (see the module doc)."""

    def __init__(self, *, max_programs: int = DEFAULT_MAX_PROGRAMS, log: Any) -> None:
        self.max_programs, self.log = max_programs, log
        self._lock = threading.Lock()
        self._entries: dict[WarmKey, WarmEntry] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def jobs(self) -> dict[str, list[str]]:
        """Job -> the nodes held for it (what ``rallypoint`` operators and tests look at)."""
        with self._lock:
            out: dict[str, list[str]] = {}
            for k in self._entries:
                out.setdefault(k[0], []).append(k[1])
            return {j: sorted(ns) for j, ns in out.items()}

    def warm(self, req: pb.WarmJobRequest, devices: Sequence[Any]) -> pb.WarmJobResponse:
        """Hold what ``req`` asks for the job, and only that; compile what is new. Returns when done.

        Raises:
            ValueError: a slice's devices do not fit this worker, or a node's slice is not in the request.
        """
        t0 = time.perf_counter()
        assignments = {sa.slice: sa for sa in req.slices}
        for sa in req.slices:
            if not sa.devices or any(not 0 <= i < len(devices) for i in sa.devices):
                raise ValueError(f"slice {sa.slice!r}: local device indices {list(sa.devices)} do not fit this "
                                 f"worker, which has {len(devices)} devices")
        missing = sorted({n.slice for n in req.nodes} - set(assignments))
        if missing:
            raise ValueError(f"nodes of slices {missing}, which the request assigns no devices")
        resp = pb.WarmJobResponse()
        keys = {program_key(req.job, n, assignments[n.slice]): n for n in req.nodes}
        todo: list[tuple[WarmKey, WarmEntry, pb.NodeProgram]] = []
        with self._lock:
            for k in [k for k in self._entries if k[0] == req.job and k not in keys]:
                del self._entries[k]
            for k, n in keys.items():
                if k in self._entries:
                    continue
                if len(self._entries) >= self.max_programs:
                    resp.failed[n.name] = f"the worker's warm budget ({self.max_programs} programs) is full"
                    continue
                self._entries[k] = entry = WarmEntry()
                todo.append((k, entry, n))
        if todo:
            meshes = {s: slice_mesh([devices[i] for i in sa.devices], sa.mesh_shape, sa.mesh_axes)
                      for s, sa in assignments.items()}
            _run_niced(lambda: self._compile_all(todo, meshes, resp))
        resp.warm_s = time.perf_counter() - t0
        self.log.info("job.warmed", job=req.job, slices=sorted(assignments), compiled=dict(resp.compile_s),
                      failed=dict(resp.failed), warm_s=round(resp.warm_s, 3), held=len(self))
        return resp

    def _compile_all(self, todo: Iterable[tuple[WarmKey, WarmEntry, pb.NodeProgram]], meshes: dict[str, Any],
                     resp: pb.WarmJobResponse) -> None:
        for k, entry, n in todo:
            t0 = time.perf_counter()
            try:
                entry.compiled = compile_exported(_deserialize(n.exported), meshes[n.slice])
                entry.compile_s = resp.compile_s[n.name] = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - best effort: the node compiles at its first call
                entry.error = resp.failed[n.name] = f"{type(exc).__name__}: {exc}"
                self.log.warning("job.warm_failed", job=k[0], node=n.name, error=entry.error)
                with self._lock:
                    if self._entries.get(k) is entry:
                        del self._entries[k]
            finally:
                entry.done.set()

    def take(self, key: WarmKey) -> WarmEntry | None:
        """The entry for ``key`` (ready or still compiling), which leaves the cache; None: not held."""
        with self._lock:
            return self._entries.pop(key, None)

    def drop_job(self, job: str) -> int:
        """Forget every executable held for ``job``; how many went."""
        with self._lock:
            gone = [k for k in self._entries if k[0] == job]
            for k in gone:
                del self._entries[k]
        if gone:
            self.log.info("job.warm_dropped", job=job, programs=len(gone))
        return len(gone)

    def loaded(self, req: pb.LoadJobRequest) -> None:
        """``req`` was loaded here (after it took its entries): this worker is no spare of that job any
        more, and executables of other jobs compiled for the devices it took could never be used."""
        taken = {d for sa in req.slices for d in sa.devices}
        with self._lock:
            gone = [k for k in self._entries if k[0] == req.job or taken & set(k[3])]
            for k in gone:
                del self._entries[k]
        if gone:
            self.log.info("job.warm_dropped", job=req.job, programs=len(gone), reason="loaded")


def _run_niced(fn: Callable[[], None]) -> None:
    """Run ``fn`` on a thread of lower CPU priority (a spare's compile yields to anything else) and wait."""
    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WARM_NICE)  # Linux: per thread
        except (OSError, AttributeError):
            pass
        fn()

    t = threading.Thread(target=run, name="warm-compile", daemon=True)
    t.start()
    t.join()
