"""The leader's silence check: the workers whose ``Attach`` streams have been quiet past ``suspect_after_s``.

Each heartbeat is read by its link's thread (:mod:`~rallypoint.orchestrator.service.links`), which stamps
``heard_at``. Silence is evidence only while this process could read: when the process itself was paused
(stopped, or starved of CPU by its host), every stream looks silent although heartbeats wait unread in its
sockets. :class:`SilenceWatch` tells the two apart with a ticker: a thread that wakes every half heartbeat
period (:meth:`SilenceWatch.tick`). A tick or a look that finds the last tick older than half the limit saw
a pause of the whole process; after one, nobody is called silent until the readers have had ``grace_s`` to
read what waited. The leader's loop being busy (an etcd call under load) is no pause: the readers ran
meanwhile, so a silent worker is suspected at the loop's next look, not a whole limit later.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Protocol

from rallypoint.basics.clock import Clock


class Heard(Protocol):
    heard_at: float  # monotonic: the last heartbeat read (or the link's start)
    suspected: bool  # its silence was reported once


class SilenceWatch:
    """Which links are silent past ``limit_s``, pauses of this process set aside (see the module doc).

    Args:
        limit_s: ``suspect_after_s`` (> 0). interval_s: the heartbeat period. clock: the injected clock.
    """

    def __init__(self, limit_s: float, interval_s: float, clock: Clock) -> None:
        self.limit_s, self.clock = limit_s, clock
        self.tick_s = interval_s / 2
        self.grace_s = max(3 * interval_s, limit_s / 2)  # readers catch up on what waited in their sockets
        self._ticked = clock.monotonic()
        self._resumed_at = float("-inf")
        self.pauses = 0  # of the whole process, seen so far

    def tick(self) -> None:
        """The ticker's beat (and each look's): a gap past half the limit since the last one was a pause."""
        now = self.clock.monotonic()
        if now - self._ticked > self.limit_s / 2:
            self._resumed_at = now
            self.pauses += 1
        self._ticked = now

    def silent(self, links: Iterable[Heard]) -> list[tuple[Heard, float]]:
        """The links not yet reported whose last heartbeat is ``limit_s`` old or more, each with its quiet
        seconds; none within ``grace_s`` after a pause of this process."""
        self.tick()
        now = self.clock.monotonic()
        if now - self._resumed_at < self.grace_s:
            return []
        return [(link, now - link.heard_at) for link in links
                if not link.suspected and now - link.heard_at >= self.limit_s]

    def run(self, stop: threading.Event) -> None:
        """The ticker: beat every half heartbeat period of real time until ``stop`` (a daemon thread's target).
        It is about this process being scheduled, so it waits in real time whatever the clock."""
        while not stop.wait(self.tick_s):
            self.tick()
