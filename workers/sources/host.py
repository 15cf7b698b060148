"""Host sources on the worker: the user's Python reads the job's data in a child process, ahead of the steps.

A host source (``prog.source(..., host=True)``, docs/data.md) is plain Python
``fn(step, microbatch) -> NumPy arrays`` from the job's code bundle. :class:`HostSource`
runs it in its own process (:mod:`rallypoint.workers.sources.child`), so a slow loader does
not hold the job's lock or the slice's thread longer than its batch takes, and one that
crashes (or leaks, or segfaults in a C library) fails the job, never the worker. It asks
for the instances in the order the slice runs them, ``prefetch`` ahead of the one that
runs; each batch is put on the slice's devices with the source's declared shardings as
it arrives (counted as ``source`` in the job's copies), so the instance that runs the
source only hands it on.

Determinism is checked, not assumed: the child sends each batch's sha256
(:func:`rallypoint.workers.sources.values.leaves_checksum`), and :class:`SourceLedger` keeps
them in the run directory, ``<run>/sources/<node>.jsonl``, where every worker that ever
runs the source reads them. A replay, or the source re-placed on another worker or on
another device count, that reads different bytes for a step fails the job naming the
source, the step and both sums. A source that raises fails the job with the user's
traceback and the step: the program's error, not the worker's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rallypoint.basics.errors import RallypointError
from rallypoint.basics.logs import get_logger
from rallypoint.etcd.keys import check_name
from rallypoint.recovery.skips import Skips
from rallypoint.workers.residency import Copies, place
from rallypoint.workers.scratch import scratch_dir
from rallypoint.workers.sources.sandbox import SourcePolicy, source_env
from rallypoint.workers.sources.values import describe_mismatch, to_dtypes

DEFAULT_PREFETCH = 4
"""Instances a host source reads ahead of the one that runs (``HostSource.prefetch`` 0)."""
STOP_WAIT_S = 2.0
"""How long a closing source's process may take to end on its own before it is killed."""
DRAIN_S = 5.0
"""How long after a source's process ended the answers it wrote before are still waited for: its output ends
with it, unless a process it started (a loader's worker) holds the pipe open."""


MAX_HEADER_BYTES = 1 << 20
"""The longest header line a source's process may send (its leaves' dtypes and shapes, the checksum)."""
MAX_ITEM_BYTES = 16
"""The widest element a source's leaf may have (complex128)."""


class SourceError(RallypointError):
    """A host source failed: it raised, its process died, or it read different bytes than before."""


class _Declared(ValueError):
    """A header announced leaves other than the source's at submit (checked before anything is allocated)."""


def _where(step: int, mb: int) -> str:
    return f"step {step}" + (f" microbatch {mb}" if mb else "")


class SourceLedger:
    """Each instance's checksum of one host source: ``<run>/sources/<node>.jsonl``, one line per
    instance ``{"s": step, "m": microbatch, "h": sha256}`` (in memory only without a run directory)."""

    def __init__(self, run_dir: str | Path | None, node: str) -> None:
        self.known: dict[tuple[int, int], str] = {}
        check_name("node", node)  # it becomes a file name on the shared file system
        self._path = Path(run_dir) / "sources" / f"{node}.jsonl" if run_dir else None
        self._lock = threading.Lock()
        if self._path is not None and self._path.exists():
            for line in self._path.read_text().splitlines():
                try:
                    r = json.loads(line)
                    self.known.setdefault((int(r["s"]), int(r["m"])), str(r["h"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a crash: that instance is checked from its next run on

    def check(self, step: int, mb: int, digest: str) -> str | None:
        """Record ``digest`` for the instance, or return the one recorded before when it differs."""
        with self._lock:
            before = self.known.get((step, mb))
            if before is not None:
                return None if before == digest else before
            self.known[(step, mb)] = digest
            if self._path is not None:
                try:
                    self._path.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    try:
                        os.write(fd, (json.dumps({"s": step, "m": mb, "h": digest}) + "\n").encode())
                    finally:
                        os.close(fd)
                except OSError:
                    pass  # a full or read-only filesystem: the sum is kept in memory, the job goes on
        return None


def instance_order(steps: int, start: int, every: int, mbs: Sequence[int],
                   skips: Skips = Skips()) -> Iterator[tuple[int, int]]:
    """The (stream position, microbatch) a source is asked for, in the order its slice runs them (``mb`` -1 is
    asked as 0): the position of each step, as ``skips`` moves it (recovery/skips.py)."""
    for step in range(start, steps):
        if step % every == 0:
            for mb in mbs:
                yield skips.position(step), max(mb, 0)


class HostSource:
    """One host source of a loaded job: its process, the batches read ahead, the checksums.

    Called by the slice's thread like a node's program, ``source(step, microbatch)``: it
    returns the instance's leaves on the slice's devices (waiting for them if they are not
    here yet), or raises :class:`SourceError`.

    Args:
        node: the source's name.
        bundle: the unpacked code bundle.
        file, name: the source's file in the bundle and its module-level name.
        outputs: the source's output names, in order.
        shardings: one per leaf, where each goes (the layout program's).
        avals: one per leaf, its dtype and shape as the source gave them at submit.
        order: the instances it will be asked for, in order.
        ledger: where the checksums are kept.
        prefetch: instances read ahead.
        copies: where the job's host-device copies are counted.
    """

    def __init__(self, node: str, *, bundle: Path, file: str, name: str, outputs: Sequence[str],
                 shardings: Sequence[Any], order: Iterator[tuple[int, int]], ledger: SourceLedger,
                 avals: Sequence[tuple[Any, tuple[int, ...]]], prefetch: int = DEFAULT_PREFETCH,
                 copies: Copies | None = None, job: str = "", mesh: Any = None,
                 policy: SourcePolicy | None = None) -> None:
        self.node, self.file, self.name = node, file, name
        self.mesh = mesh
        self.in_shardings = None  # the step and microbatch stay Python numbers (runtime_inputs.take)
        self._shardings = list(shardings)
        self._avals = [(np.dtype(d), tuple(sh)) for d, sh in avals]  # (dtype, shape) of each leaf, as at submit
        self._ledger, self._copies = ledger, copies
        self._order = order
        self._depth = max(int(prefetch) or DEFAULT_PREFETCH, 1)
        self._cv = threading.Condition()
        self._asked: deque[tuple[int, int]] = deque()  # sent to the process, in order
        self._ready: dict[tuple[int, int], list[Any] | SourceError] = {}
        self._skip: set[tuple[int, int]] = set()  # asked out of order: the order passes over them
        self._closed = False
        self._dead = ""  # why it can answer nothing more (set once: _die)
        self._dead_at = 0.0
        self._log = get_logger("rallypoint.source", job=job, node=node)
        policy = policy or SourcePolicy()
        self._tmp = scratch_dir("source")  # its TMPDIR: the one place it may write
        self._proc = subprocess.Popen(  # a scrubbed environment, and restricted before the job's code (sandbox.py)
            [sys.executable, "-m", "rallypoint.workers.sources.child", str(bundle), file, name, ",".join(outputs),
             policy.args(self._tmp, str(Path(bundle).parent))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=source_env(os.environ, self._tmp, policy.extra),
            cwd=str(bundle),
        )
        self.pid = self._proc.pid
        self._reader = threading.Thread(target=self._read, name=f"source-{node}", daemon=True)
        self._reader.start()
        with self._cv:
            self._top_up()

    # -- the slice's side ---------------------------------------------------------------

    def __call__(self, step: Any, microbatch: Any) -> list[Any]:
        key = (int(step), int(microbatch))
        with self._cv:
            if key not in self._ready and key not in self._asked:
                self._ask(key)  # out of the expected order: read it now, and not again when the order gets there
                self._skip.add(key)
            while key not in self._ready:
                if self._closed:
                    raise SourceError(f"host source {self.node!r} was closed")
                if self._dead and not self._answer_may_come(key):
                    raise SourceError(self._dead)
                if not self._reader.is_alive() and key not in self._ready:
                    raise SourceError(f"host source {self.node!r}: its reader stopped before step {key[0]} came")
                self._cv.wait(1.0)
            value = self._ready.pop(key)
            self._top_up()
        if isinstance(value, SourceError):
            raise value
        return value

    def first_report(self) -> tuple[str, float] | None:
        return None  # nothing compiles

    def close(self) -> None:
        """Stop the process (by its pid: closed stdin, then SIGKILL) and the reader."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(STOP_WAIT_S)
        if self._proc.stdout is not None and not self._reader.is_alive():  # (a read in progress holds its lock)
            self._proc.stdout.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    # -- the process's side -------------------------------------------------------------

    def _ask(self, key: tuple[int, int]) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(f"{key[0]} {key[1]}\n".encode())
            self._proc.stdin.flush()
        except (OSError, ValueError):  # its input is closed: it is ending, most likely
            if not self._dead:
                self._wait_briefly()  # for its exit code, as the reader does (else "stopped answering" wins a race)
                self._die(self._ended())
                if self._proc.poll() is None:  # it closed its input and lives on: nothing more can be asked of it,
                    self._proc.kill()  # and its end lets the reader finish the answers it wrote before
            self._cv.notify_all()
            return
        self._asked.append(key)

    def _die(self, why: str) -> None:
        """The process can answer nothing more, and why (the first reason found stays; under the lock)."""
        if not self._dead:
            self._dead, self._dead_at = why, time.monotonic()

    def _answer_may_come(self, key: tuple[int, int]) -> bool:
        """Whether ``key``'s answer may still be read after the process ended: it was asked, the reader is still
        reading what the process wrote before, and not for longer than :data:`DRAIN_S` (under the lock)."""
        return key in self._asked and self._reader.is_alive() and time.monotonic() - self._dead_at < DRAIN_S

    def _top_up(self) -> None:
        """Keep ``prefetch`` instances asked for or read ahead (under the lock)."""
        while not self._closed and not self._dead and len(self._asked) + len(self._ready) < self._depth:
            key = next(self._order, None)
            if key is None:
                return
            if key in self._skip:
                self._skip.discard(key)
            elif key not in self._ready and key not in self._asked:
                self._ask(key)

    def _ended(self) -> str:
        code = self._proc.poll()
        how = f"exited with code {code}" if code is not None and code >= 0 else \
            f"was killed by signal {-code}" if code is not None else "stopped answering"
        return (f"host source {self.node!r} ({self.file}: {self.name}): its process (pid {self.pid}) {how}; "
                "its output above in the worker's log says why")

    def _read(self) -> None:
        """The reader thread: every answer of the process, in order, until it ends. Any error of its own
        (a protocol broken, a declared shape out of bounds, no memory) fails the source, naming the step: it
        never dies leaving a step waiting."""
        out = self._proc.stdout
        assert out is not None
        while True:
            where = "its output"
            try:
                line = out.readline(MAX_HEADER_BYTES)
                if not line:  # the process ended (or closed its output): whatever it was asked fails
                    if not self._closed:
                        self._wait_briefly()  # for its exit code
                    with self._cv:
                        if not self._closed:
                            self._die(self._ended())
                            self._log.warning("source.died", error=self._dead)
                        self._cv.notify_all()
                    return
                if not line.endswith(b"\n"):
                    raise ValueError(f"a header line of over {MAX_HEADER_BYTES} bytes")
                header = json.loads(line)
                key = (int(header["s"]), int(header["m"]))
                where = _where(*key)
                value = self._value(key, header, out)
            except BaseException as exc:  # noqa: BLE001 - whatever it is, the job fails with it, not a hang
                self._fail(where, exc)
                return
            with self._cv:
                if self._asked and self._asked[0] == key:
                    self._asked.popleft()
                elif key in self._asked:
                    self._asked.remove(key)
                self._ready[key] = value
                self._cv.notify_all()

    def _fail(self, where: str, exc: BaseException) -> None:
        what = f"host source {self.node!r} ({self.file}: {self.name})"
        if isinstance(exc, _Declared):
            msg = f"{what} at {where}: {exc}"
        elif isinstance(exc, (ValueError, KeyError, TypeError, EOFError)):
            msg = f"{what}: its process broke the protocol at {where}: {type(exc).__name__}: {exc}"
        else:
            msg = f"{what}: reading its output at {where} failed: {type(exc).__name__}: {exc}"
        with self._cv:
            self._die(msg)
            self._cv.notify_all()
        self._log.warning("source.failed", error=msg)
        try:
            self._proc.kill()  # its output is out of step now: nothing more is read from it
        except OSError:
            pass

    def _declared(self, header: dict[str, Any]) -> list[tuple[np.dtype, tuple[int, ...]]]:
        """The leaves a header announces, checked against the source's avals before anything is allocated."""
        leaves = header["leaves"]
        if not isinstance(leaves, list) or len(leaves) != len(self._avals):
            n = len(leaves) if isinstance(leaves, list) else "no list of"
            raise _Declared(f"it announced {n} arrays, where at submit it returned {len(self._avals)}")
        declared = []
        for dtype, shape in leaves:
            d = np.dtype(dtype)
            if d.kind not in "biufc" or d.itemsize > MAX_ITEM_BYTES:
                raise _Declared(f"it announced an array of dtype {d}, not a number of at most {MAX_ITEM_BYTES} bytes")
            declared.append((d, tuple(int(x) for x in shape)))
        got = [(w, sh) for (_, sh), (w, _) in zip(declared, self._avals)]
        if got != self._avals:
            raise _Declared(f"{describe_mismatch(got, self._avals)}: a source's shapes and dtypes are fixed for the "
                            "run")
        return declared

    def _wait_briefly(self) -> None:
        try:
            self._proc.wait(1.0)
        except subprocess.TimeoutExpired:
            pass

    def _value(self, key: tuple[int, int], header: dict[str, Any], out: Any) -> list[Any] | SourceError:
        step, mb = key
        where = _where(step, mb)
        if "error" in header:
            return SourceError(f"host source {self.node!r} ({self.file}: {self.name}) raised at {where}:\n"
                               f"{header['error'].rstrip()}")
        leaves = []
        for dtype, shape in self._declared(header):  # no allocation past what the source declared at submit
            a = np.empty(shape, dtype=dtype)
            view = memoryview(a).cast("B") if a.nbytes else None
            if view is not None:
                got = out.readinto(view)
                if got != a.nbytes:
                    raise EOFError(f"{got} of {a.nbytes} bytes of a leaf")
            leaves.append(a)
        before = self._ledger.check(step, mb, header["sum"])
        if before is not None:
            return SourceError(
                f"host source {self.node!r} ({self.file}: {self.name}) read different bytes at {where} than when "
                f"it first ran (sha256 {before[:16]}... then, {header['sum'][:16]}... now): a source must be a "
                "deterministic function of (step, microbatch): seed its shuffles from them and read files "
                "that do not change during the run (docs/data.md)")
        leaves = to_dtypes(leaves, [d for d, _ in self._avals])  # the client's 64 -> 32 bits, as the reference
        got = [(a.dtype, tuple(a.shape)) for a in leaves]
        if got != self._avals:
            return SourceError(f"host source {self.node!r} ({self.file}: {self.name}) at {where}: "
                               f"{describe_mismatch(got, self._avals)}: a source's shapes and dtypes are fixed for "
                               "the run")
        try:
            return place(leaves, self._shardings, self._copies, "source")
        except Exception as exc:  # e.g. a shape the sharding does not divide: the program's
            return SourceError(f"host source {self.node!r} at {where}: its arrays do not fit the slice: "
                               f"{type(exc).__name__}: {exc}")


def start_host_sources(req: Any, nodes: Any, code: Any, copies: Copies | None,
                       policy: SourcePolicy | None = None, skips: Skips = Skips()) -> list[HostSource]:
    """A :class:`HostSource` for each host source of the load, in place of its node's program call.

    ``nodes``: the loaded nodes (``runtime_load.LoadedNode``); ``code``: the worker's
    :class:`~rallypoint.workers.code.CodeCache`; ``policy``: what the sources' processes may reach (sandbox.py);
    ``skips``: the stream positions the run skips (recovery/skips.py).

    Raises:
        CodeError: the job's code bundle cannot be used.
    """
    started: list[HostSource] = []
    hosts = [n for n in nodes.values() if n.prog.HasField("host_source")]
    if not hosts:
        return started
    bundle = code.get(req.checkpoint_dir, req.code_sha256)
    try:
        for n in hosts:
            hs = n.prog.host_source
            exp = n.call.exported
            started.append(HostSource(
                n.prog.name, bundle=bundle, file=hs.file, name=hs.name, outputs=[o.name for o in n.prog.outputs],
                shardings=n.call.in_shardings, avals=[(a.dtype, a.shape) for a in exp.in_avals],
                order=instance_order(int(req.steps), int(req.start_step), n.prog.every, n.mbs, skips),
                ledger=SourceLedger(req.checkpoint_dir or None, n.prog.name), prefetch=hs.prefetch,
                copies=copies, job=req.job, mesh=n.call.mesh, policy=policy))
            n.call = started[-1]
    except BaseException:
        for s in started:
            s.close()
        raise
    return started
