"""What a job's drains read from etcd, read off the executor's event path.

The drains (job/drains.py) start on requests kept in etcd: an operator's or a preemption's drain
request of a worker, a higher-priority job's yield request of a slice, and (for a slice that runs
shrunk) the cluster's room. Reading them is three etcd round trips; made on the executor's thread, every
``READ_EVERY_S``, they held up the workers' events behind them. :class:`RequestReader` reads them on a
thread of its own instead and hands the executor the newest reading (:meth:`RequestReader.take`), which
never waits: the executor acts on requests at most ``READ_EVERY_S`` (and its own loop's wait) after they
were made, as before, and an event never waits for etcd.

The thread runs while the executor asks (it ends ``IDLE_S`` after the last :meth:`take`: the job ended).
Under an injected clock (tests drive time by hand) the reads are made on the caller's thread at the
clock's period instead: a thread on the real clock could not keep to a clock driven by hand.
A reading started before :meth:`RequestReader.invalidate` (a drain started or ended since) is dropped:
the drains act on what etcd held after their own change.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rallypoint.basics.clock import Clock, SystemClock
from rallypoint.basics.errors import StoreError
from rallypoint.etcd.cluster_view import ClusterSnapshot
from rallypoint.etcd.drains import DrainRequest

READ_EVERY_S = 0.5  # how often drain and yield requests are read (a drain starts within about this)
IDLE_S = 2.0  # no take for this long: the reading thread ends (the next take starts another)


@dataclass(frozen=True)
class Requests:
    """One reading: the drain requests by worker, this job's yield requests by slice, and the cluster (when
    asked for: a slice runs shrunk and looks for room); ``started``: when the reading began (monotonic)."""

    drains: dict[str, DrainRequest] = field(default_factory=dict)
    yields: dict[str, dict[str, Any]] = field(default_factory=dict)
    cluster: ClusterSnapshot | None = None
    started: float = 0.0


class RequestReader:
    """Reads with ``read(with_cluster)`` every ``period_s`` (see the module doc); ``log``: the executor's logger."""

    def __init__(self, read: Callable[[bool, float], Requests], *, clock: Clock, log: Any,
                 period_s: float = READ_EVERY_S) -> None:
        self._read, self._clock, self._log, self._period = read, clock, log, period_s
        self._background = isinstance(clock, SystemClock)
        self._lock = threading.Lock()
        self._got: Requests | None = None
        self._asked = self._since = 0.0
        self._inline_at = float("-inf")
        self.with_cluster = False  # the readings read the cluster too (set by the caller)
        self._thread: threading.Thread | None = None

    def take(self) -> Requests | None:
        """The newest reading not taken yet (None: none since), never waiting."""
        if not self._background:
            now = self._clock.monotonic()
            if now - self._inline_at < self._period:
                return None
            self._inline_at = now
            try:
                return self._read(self.with_cluster, now)
            except StoreError:
                return None  # etcd is away: the requests wait
        self._asked = time.monotonic()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="job-requests", daemon=True)
            self._thread.start()
        with self._lock:
            got, self._got = self._got, None
        return got if got is not None and got.started >= self._since else None

    def invalidate(self) -> None:
        """What was read until now is stale (the drains changed what etcd holds): wait for a newer reading."""
        self._since = time.monotonic() if self._background else self._clock.monotonic()
        with self._lock:
            self._got = None
        self._inline_at = float("-inf")

    def _run(self) -> None:
        while time.monotonic() - self._asked < IDLE_S:
            started = time.monotonic()
            try:
                got = self._read(self.with_cluster, started)
            except StoreError:
                got = None  # etcd is away: the requests wait
            except Exception as exc:  # a bug must not end the reads (the drains would never start again)
                self._log.warning("job.requests_read_failed", error=repr(exc))
                got = None
            if got is not None:
                with self._lock:
                    self._got = got
            time.sleep(max(0.0, self._period - (time.monotonic() - started)))
