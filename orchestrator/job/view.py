"""What outside code reads of one job: a frozen snapshot (:class:`JobView`) and the calls it may make
(:class:`JobHandle`).

The executor (:meth:`~rallypoint.orchestrator.job.executor.JobExecutor.view`) builds a
:class:`JobView` from the owner of each fact (progress, placement, recoveries, drains, the stop
asked); the job record (:func:`~rallypoint.orchestrator.job.record.record_of`), the dashboard's
timeline, the Prometheus metrics and the job service read that, never the executor's fields.
A view is a copy: it does not change after it is made, and reading it never moves the job.

:class:`JobHandle` lists exactly what the job service does with an executor: run it in its
thread, hand it off, tell it of a fenced worker, pass it a suspend or cancel, and take views.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from rallypoint.orchestrator.job.drain import DrainRecord
from rallypoint.orchestrator.job.goodput import Histogram
from rallypoint.orchestrator.job.recovery import RecoveryRecord, Reshard
from rallypoint.orchestrator.job.state import JobState
from rallypoint.orchestrator.job.stop import StopRequest
from rallypoint.recovery.load_plan import SlicePlace

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _empty() -> Mapping[str, Any]:
    return _EMPTY


@dataclass(frozen=True)
class JobView:
    """One job as its executor holds it at one moment (module doc). Built on the executor's thread
    it is consistent; built on another (a metrics scrape) each part is a copy taken in turn."""

    job: str
    state: JobState
    steps: int = 0
    priority: int = 0
    submit_id: str = ""
    owner: str = ""  # who submitted it, by its certificate (ROLE:NAME; "" without TLS)
    code_sha256: str = ""
    spec_sha256: str = ""  # the run's jobspec.pb, as it wrote it (job/run_files.py)
    term: int = 0
    run_id: str = ""  # this run of the job name (orchestrator/job/runs.py)
    run_dir: Path | None = None
    adopted: bool = False
    resumed: bool = False
    auto_resumed: bool = False  # the leader resumed it once room returned (service/verbs.py)
    policy: str = ""  # the recovery policy ("" before the job's settings are read)
    completed: int = 0  # steps done, absolute
    start_step: int = 0  # where this executor's run began (a resume's cut)
    cut: int = -1
    placement: Mapping[str, SlicePlace] = field(default_factory=_empty)
    done_through: Mapping[str, int] = field(default_factory=_empty)  # per node: every step below is done
    replayed: Mapping[str, int] = field(default_factory=_empty)  # instances run again, per node
    compute_s: Mapping[str, float] = field(default_factory=_empty)  # first runs' compute seconds, per node
    redone_s: float = 0.0  # replays' compute seconds
    step_times: Mapping[str, Histogram] = field(default_factory=_empty)  # per slice (docs/metrics.md)
    recoveries: tuple[RecoveryRecord, ...] = ()  # this term's
    recovery_entries: tuple[Any, ...] = ()  # every recovery (an earlier term's too), each with ``to_json()``
    failures: tuple[Mapping[str, Any], ...] = ()
    drain_records: tuple[DrainRecord, ...] = ()
    resharded: tuple[Reshard, ...] = ()
    stop: StopRequest | None = None  # a suspend or cancel asked and not yet carried out
    stalls: int = 0
    integrity: Mapping[str, Any] = field(default_factory=_empty)  # skips and rollbacks (job/rollback.py to_json)
    started_at: float = 0.0  # wall time of the run's first start (a resume keeps it)
    running_s: float = 0.0  # seconds this executor has run (until it ended)
    at: float = 0.0  # wall time, on the job's clock, when the view was taken (the record's ``at``)

    def recoveries_json(self) -> list[dict[str, Any]]:
        """Every recovery as the record and ``job.watching`` show it."""
        return [r.to_json() for r in self.recovery_entries]

    def drains_json(self) -> list[dict[str, Any]]:
        return [d.to_json() for d in self.drain_records]


@runtime_checkable
class JobHandle(Protocol):
    """What the job service calls on an executor (:class:`~rallypoint.orchestrator.job.executor.JobExecutor`,
    or a test's stand-in). Anything else the service knows of a job it reads from :meth:`view`."""

    def run(self) -> Any:
        """Run the job to its end on the calling thread; never raises (the end is an event)."""

    def stop(self, reason: str) -> None:
        """This coordinator's term ended: end the run soon with ``job.handed_off`` (any thread)."""

    def worker_fenced(self, worker: str, incarnation: int, reason: str) -> None:
        """The leader fenced ``worker`` (any thread): recover it if the job runs on that incarnation."""

    def request_stop(self, request: StopRequest) -> bool:
        """A suspend or cancel taken by the leader, carried out at the next step boundary (any thread)."""

    def view(self) -> JobView:
        """The job now, as a frozen snapshot."""
