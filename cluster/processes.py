"""Process supervision: the daemon processes a launcher started, found and stopped by their own ids.

A process is recorded as a :class:`ProcessRecord`: its pid *and* its kernel start time,
so a pid the kernel later reuses for an unrelated process (another start time) is never
taken for it: :func:`is_running` says no and :func:`stop_process` leaves it alone. A
:class:`Supervisor` holds the records of one local cluster (:mod:`rallypoint.cluster.local`):
it starts a process into its log file, finds one by name, signals it, reaps it, and
stops them all in order. It knows nothing of certificates, etcd or the state file.

It also restarts coordinators and workers that die (:meth:`Supervisor.restart_exited`, under a
:class:`RestartPolicy`), as systemd or Kubernetes would on real hosts: with exponential backoff,
and not past a limit of restarts in a window (a process that keeps dying stays down and is
reported). A restarted worker registers as a new incarnation (a spare), a restarted
coordinator campaigns again (a standby).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rallypoint.basics.errors import RallypointError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
STOP_ORDER = {"supervisor": -1, "worker": 0, "coordinator": 1, "etcd": 2}  # others after these
SUPERVISED = ("coordinator", "worker")  # the roles restarted when they die (etcd members are the operator's)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a process that died is started again.

    The n-th restart within ``window_s`` waits ``backoff_s * 2**(n-1)`` seconds (at most
    ``max_backoff_s``); past ``limit`` restarts within ``window_s`` the process stays down.
    A process that ran ``healthy_after_s`` or longer before it died was not crash-looping
    (it was killed, preempted, partitioned): its restarts so far no longer count, and its
    backoff starts over (Kubernetes resets a container's backoff after it ran for a while),
    so a long storm of faults does not use up a healthy process's restarts.
    systemd: ``Restart=always``, ``RestartSec``, ``StartLimitBurst``, ``StartLimitIntervalSec``;
    Kubernetes: ``restartPolicy: Always`` and its crash-loop backoff (docs/operations.md).
    """

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    limit: int = 5
    window_s: float = 300.0
    healthy_after_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("backoff_s", "max_backoff_s", "window_s", "healthy_after_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"restart {name} must be a number of seconds >= 0, got {v!r}")
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 0:
            raise ValueError(f"restart limit must be a whole number >= 0, got {self.limit!r}")

    def delay(self, recent: int) -> float:
        """The wait before a restart that follows ``recent`` restarts within the window."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** recent))


@dataclass
class ProcessRecord:
    """A process the cluster started: enough to find and stop exactly it."""

    role: str
    name: str
    pid: int
    start_time: int
    log: str
    argv: list[str] = field(default_factory=list)


def process_start_time(pid: int) -> int | None:
    """The kernel start time of ``pid`` (clock ticks since boot), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def is_running(rec: ProcessRecord) -> bool:
    """Whether the recorded process (same pid *and* start time) still runs."""
    return process_start_time(rec.pid) == rec.start_time


def stop_process(rec: ProcessRecord, *, grace_s: float = 5.0, sig: int = signal.SIGINT) -> None:
    """Stop one recorded process: ``sig``, then SIGKILL after ``grace_s``. Reaps it if it is our child.

    SIGINT, not SIGTERM: a worker takes SIGTERM as a preemption notice and first waits to be drained.
    """
    if not is_running(rec):
        _reap(rec.pid)
        return
    try:
        os.kill(rec.pid, sig)
        os.kill(rec.pid, signal.SIGCONT)  # a stopped process must run to handle the signal
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(rec.pid)
        if not is_running(rec):
            return
        time.sleep(0.05)
    try:
        os.kill(rec.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    for _ in range(100):
        _reap(rec.pid)
        if not is_running(rec):
            return
        time.sleep(0.02)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def child_env(extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a daemon is started with: this process's, unbuffered, the project importable, ``extra_env``."""
    env = os.environ | {"PYTHONUNBUFFERED": "1"} | (extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
    return env


def log_tail(path: str, lines: int = 15) -> str:
    """The last ``lines`` lines of a process's log ("(no log)" when it cannot be read)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Supervisor:
    """The recorded processes of one cluster: starts, finds, signals and stops them.

    ``records`` are every process recorded (also those started by another process and
    loaded from the state file); only those started here are its children, which it
    reaps through their ``Popen`` handles.
    """

    def __init__(self, records: list[ProcessRecord]) -> None:
        self.records = records
        self._popen: dict[str, subprocess.Popen[bytes]] = {}
        self.restarts: dict[str, list[float]] = {}  # name -> when it was restarted (monotonic)
        self.given_up: dict[str, str] = {}  # name -> why it stays down
        self._due: dict[str, float] = {}  # name -> when its restart is due

    def launch(self, role: str, name: str, argv: list[str], log_path: Path, *,
               extra_env: dict[str, str] | None = None) -> ProcessRecord:
        """Start ``argv`` in its own session, output appended to ``log_path``; record it (replacing ``name``'s)."""
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=child_env(extra_env), cwd=str(PROJECT_ROOT),
            )
        self._popen[name] = proc
        return self.adopt(role, name, proc.pid, log_path, argv)

    def adopt(self, role: str, name: str, pid: int, log_path: Path, argv: list[str]) -> ProcessRecord:
        """Record ``pid``, started for ``name`` by another process (the zygote), replacing ``name``'s record."""
        rec = ProcessRecord(role, name, pid, process_start_time(pid) or 0, str(log_path), argv)
        self.records = [p for p in self.records if p.name != name] + [rec]
        return rec

    def find(self, name: str) -> ProcessRecord:
        for p in self.records:
            if p.name == name:
                return p
        raise RallypointError(f"no process named {name!r} in this cluster")

    def exited(self) -> list[ProcessRecord]:
        """The recorded coordinators and workers (and supervisor) that no longer run. A zygote gone is not one:
        the workers are then started the usual way."""
        return [p for p in self.records if p.role not in ("etcd", "zygote") and not is_running(p)]

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to the recorded process ``name`` (only if it is still that process)."""
        rec = self.find(name)
        if not is_running(rec):
            raise RallypointError(f"process {name!r} (pid {rec.pid}) is not running")
        os.kill(rec.pid, sig)
        if sig == signal.SIGKILL:
            self.reap(name)

    def restart_exited(self, now: float, relaunch: Callable[[ProcessRecord], ProcessRecord],
                       policy: RestartPolicy) -> list[tuple[ProcessRecord, ProcessRecord]]:
        """One pass of supervision at monotonic time ``now``: each coordinator or worker that died is
        restarted through ``relaunch`` once its backoff has passed. Returns ``(dead, new)`` pairs."""
        out = []
        for rec in list(self.records):
            if rec.role not in SUPERVISED or rec.name in self.given_up:
                continue
            if is_running(rec):
                self._due.pop(rec.name, None)
                continue
            self._reap_child(rec)
            history = self.restarts.get(rec.name, [])
            if rec.name not in self._due and history and now - history[-1] >= policy.healthy_after_s:
                self.restarts[rec.name] = history = []  # it ran a while before it died: not a crash loop
            recent = [t for t in history if now - t < policy.window_s]
            if len(recent) >= policy.limit:
                self.given_up[rec.name] = (f"died {len(recent) + 1} times within {policy.window_s:g} s (restart limit "
                                           f"{policy.limit}); it stays down: see its log {rec.log}")
                continue
            due = self._due.setdefault(rec.name, now + policy.delay(len(recent)))
            if now >= due:
                del self._due[rec.name]
                self.restarts[rec.name] = [*recent, now]
                out.append((rec, relaunch(rec)))
        return out

    def _reap_child(self, rec: ProcessRecord) -> None:
        proc = self._popen.get(rec.name)
        if proc is not None and proc.pid == rec.pid:
            proc.poll()
        else:
            _reap(rec.pid)

    def reap(self, name: str, timeout_s: float = 5.0) -> None:
        proc = self._popen.get(name)
        if proc is not None:
            proc.wait(timeout=timeout_s)

    def stop_all(self) -> None:
        """Stop every recorded process: workers, then coordinators, then etcd; the processes of one role
        together (each may take its grace to leave cleanly: one after another, a cluster of N workers took N)."""
        for order in sorted({STOP_ORDER.get(p.role, 3) for p in self.records}):
            threads = [threading.Thread(target=self._stop_one, args=(rec,), name=f"stop-{rec.name}")
                       for rec in self.records if STOP_ORDER.get(rec.role, 3) == order]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    def _stop_one(self, rec: ProcessRecord) -> None:
        stop_process(rec)
        proc = self._popen.get(rec.name)
        if proc is not None:
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
