"""The job service's stand-ins (orchestrator/service/jobs.py on its own): an executor that implements
:class:`~rallypoint.orchestrator.job.view.JobHandle` and runs until told, a gRPC context that raises on
abort, an election whose term reads are recorded, and :func:`service_with_stand_ins` that builds a
:class:`~rallypoint.orchestrator.service.jobs.CoordinatorService` on a :class:`~tests.fakes.MemoryStore`
with them. tests/orchestrator/test_stand_ins.py keeps the stand-in executor true to ``JobHandle``."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from rallypoint.basics.clock import FakeClock
from rallypoint.etcd.keys import Keys
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from rallypoint.orchestrator.job.runs import JOBSPEC_FILE
from rallypoint.orchestrator.job.state import JobState
from rallypoint.orchestrator.job.stop import StopRequest
from rallypoint.orchestrator.job.view import JobView
from rallypoint.orchestrator.service import jobs as service_mod
from rallypoint.proto import rallypoint_pb2 as pb
from tests.fakes import MemoryStore


class StandInExecutor:
    """A job executor as the service uses it (:class:`JobHandle`): it emits ``job.placed`` (``job.adopted``
    when adopted), then waits until ``go`` is set (``job.finished``) or it is stopped (``job.handed_off``).
    Every one made is in :attr:`made`; what the service asked of it is kept (``stopped``, ``fenced``,
    ``stops_asked``)."""

    made: list[StandInExecutor] = []

    def __init__(self, spec: pb.JobSpec, *, store: Any, keys: Any, election: Any, emit: Callable[[pb.JobEvent], None],
                 clock: Any, checkpoint_root: str, resume: bool, adopted: bool = False,
                 hooks: ExecutorHooks = ExecutorHooks(), keep_runs: int = 0, auto_resumed: bool = False) -> None:
        self.spec, self.emit, self.checkpoint_root = spec, emit, checkpoint_root
        self.resume, self.adopted, self.hooks = resume, adopted, hooks
        self.keep_runs, self.auto_resumed = keep_runs, auto_resumed
        self.completed = 0
        self.state = JobState.RUNNING
        self.placement: dict[str, Any] = {}
        self.run_id = ""
        self.run_dir: Path | None = None
        self.stopped: str | None = None
        self.fenced: list[tuple[str, int, str]] = []
        self.stops_asked: list[StopRequest] = []
        self.go = threading.Event()
        StandInExecutor.made.append(self)

    def run(self) -> JobState:
        self.emit(pb.JobEvent(job=self.spec.job, event="job.adopted" if self.adopted else "job.placed"))
        while not self.go.wait(0.01):
            if self.stopped is not None:
                self.emit(pb.JobEvent(job=self.spec.job, event="job.handed_off", step=self.completed,
                                      detail=json.dumps({"reason": self.stopped})))
                return JobState.HANDED_OFF
        self.completed = self.spec.steps
        self.emit(pb.JobEvent(job=self.spec.job, event="job.finished", step=self.spec.steps))
        return JobState.SUCCEEDED

    def stop(self, reason: str) -> None:
        self.stopped = reason

    def worker_fenced(self, worker: str, incarnation: int, reason: str) -> None:
        self.fenced.append((worker, incarnation, reason))

    def request_stop(self, request: StopRequest) -> bool:
        self.stops_asked.append(request)
        return len(self.stops_asked) == 1  # the first request is taken, as JobStop takes it

    def view(self) -> JobView:
        return JobView(job=self.spec.job, state=self.state, steps=self.spec.steps, priority=self.spec.priority,
                       submit_id=self.spec.submit_id, run_id=self.run_id, run_dir=self.run_dir, adopted=self.adopted,
                       resumed=self.resume, auto_resumed=self.auto_resumed, completed=self.completed,
                       placement=dict(self.placement), stop=self.stops_asked[0] if self.stops_asked else None)


class Context:
    """A gRPC servicer context: ``abort`` raises :class:`Aborted`."""

    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}  # no certificate: a plain-TCP caller (tests/security/ checks identities on the real wire)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class StandInElection:
    """The coordinator's election as the service sees it; every read of ``term`` is recorded with the thread
    that read it, so a test can wait until the service has looked at the term, instead of sleeping."""

    def __init__(self) -> None:
        self._term: int | None = 7
        self.is_leader = True
        self.keeper: Any = SimpleNamespace(fence=SimpleNamespace(dead=False))
        self.readers: list[threading.Thread] = []

    @property
    def term(self) -> int | None:
        self.readers.append(threading.current_thread())
        return self._term

    @term.setter
    def term(self, value: int | None) -> None:
        self._term = value

    def current_leader(self) -> tuple[str, int]:
        return ("c0", 7)


def looked_at_the_term(election: StandInElection, since: int) -> threading.Thread | None:
    """The service thread that has read the term three times since read number ``since`` (one whole decision
    and the start of the next: it chose to keep waiting), if any."""
    readers = Counter(t for t in election.readers[since:] if t is not threading.main_thread())
    return next((t for t, n in readers.items() if n >= 3), None)


def service_with_stand_ins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Any, Any]:
    """A job service whose executors are :class:`StandInExecutor`, on a MemoryStore, leading term 7;
    checkpoints under ``tmp_path``. Returns the service and its stand-in coordinator."""
    monkeypatch.setattr(service_mod, "JobExecutor", StandInExecutor)
    StandInExecutor.made.clear()
    election = StandInElection()
    listeners: list[Any] = []
    fence_listeners: list[Any] = []
    c = SimpleNamespace(store=MemoryStore(), keys=Keys("t"), election=election, clock=FakeClock(), stopping=False,
                        config=SimpleNamespace(coordinator_id="c0", checkpoint_dir=str(tmp_path),
                                               hooks=ExecutorHooks()),
                        add_leadership_listener=lambda a, b: listeners.append((a, b)),
                        add_fence_listener=fence_listeners.append)
    svc = service_mod.CoordinatorService(c)  # type: ignore[arg-type]
    assert listeners == [(svc.on_lead, svc.on_step_down)] and fence_listeners == [svc.on_fenced]
    return svc, c


def saved_run(tmp_path: Path, job: str) -> Path:
    """``<tmp_path>/<job>/run-1`` with a 3-step spec of ``job``: what an adoption reads."""
    rd = tmp_path / job / "run-1"
    rd.mkdir(parents=True)
    (rd / JOBSPEC_FILE).write_bytes(pb.JobSpec(job=job, steps=3).SerializeToString())
    return rd
