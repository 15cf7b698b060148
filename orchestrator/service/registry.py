"""The jobs one coordinator runs now, and the ends of those it ran lately.

A job name runs once at a time here: :meth:`RunRegistry.add` refuses a second run of a name that
runs. When a run ends (:meth:`RunRegistry.ended`) it leaves the registry, and its last event is kept
for a while (the newest :data:`KEEP_ENDED`, for :data:`KEEP_ENDED_S`): a client that lost its stream
just as the job ended still gets the end from ``WatchJob``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from rallypoint.orchestrator.job.state import END_EVENTS
from rallypoint.orchestrator.job.view import JobHandle
from rallypoint.orchestrator.service.fanout import EventFanOut
from rallypoint.proto import rallypoint_pb2 as pb

KEEP_ENDED = 4  # ended jobs whose last event (final states included) WatchJob still answers with ...
KEEP_ENDED_S = 300.0  # ... for this long: a client that lost its stream just as the job ended


@dataclass
class JobRun:
    """One job this coordinator runs: its executor, the term it runs under, its events' streams."""

    job: str
    term: int
    adopted: bool
    executor: JobHandle
    events: EventFanOut  # the executor's emit ends in events.publish
    first: queue.Queue[pb.JobEvent] | None = None  # the stream that started it, subscribed before it starts
    done: threading.Event = field(default_factory=threading.Event)  # set once its thread is over


class RunRegistry:
    """The runs of one coordinator, by job name (thread-safe; see the module doc)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._runs: dict[str, JobRun] = {}
        self._ended: OrderedDict[str, tuple[pb.JobEvent, float]] = OrderedDict()  # job -> (its end, when)
        self._lock = threading.Lock()
        self._clock = clock

    def get(self, job: str) -> JobRun | None:
        """The run of ``job`` here now (None: it runs none)."""
        with self._lock:
            return self._runs.get(job)

    def all(self) -> list[JobRun]:
        with self._lock:
            return list(self._runs.values())

    def add(self, job: str, make: Callable[[], JobRun]) -> JobRun | None:
        """Register the run ``make()`` builds (under the registry's lock); None, building nothing, if ``job``
        runs here already."""
        with self._lock:
            if job in self._runs:
                return None
            run = self._runs[job] = make()
            self._ended.pop(job, None)
            return run

    def ended(self, run: JobRun) -> None:
        """``run``'s thread is over: it leaves the registry, and its last event is kept if it ended the job."""
        with self._lock:
            if self._runs.get(run.job) is run:
                del self._runs[run.job]
            last = run.events.last
            if last is not None and last.event in END_EVENTS:
                self._ended[run.job] = (last, self._clock())
                while len(self._ended) > KEEP_ENDED:
                    self._ended.popitem(last=False)
        run.done.set()

    def ended_here(self, job: str) -> bool:
        """Whether a run of ``job`` ended here lately (its end is kept)."""
        with self._lock:
            return job in self._ended

    def lookup(self, job: str) -> tuple[JobRun | None, pb.JobEvent | None]:
        """The run of ``job`` here now, and the last event of one that ended here within ``KEEP_ENDED_S``."""
        with self._lock:
            run, kept = self._runs.get(job), self._ended.get(job)
        ended = kept[0] if kept is not None and self._clock() - kept[1] < KEEP_ENDED_S else None
        return run, ended
