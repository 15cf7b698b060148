"""A loaded job's event feed: the ``InstanceDone`` events its ``JobEvents`` streams read.

A stream sends what its queue holds in one :class:`pb.InstanceDoneBatch` (:func:`drain_events`): the
instances that completed while the previous message was on its way go together, in order.
"""

from __future__ import annotations

import queue
import threading
from collections import deque

from rallypoint.proto import rallypoint_pb2 as pb

BACKLOG_EVENTS = 100_000  # events kept while no JobEvents stream is open
MAX_BATCH = 512  # events in one InstanceDoneBatch at most (a backlog handed over goes in several)


class EventFeed:
    """Hands each event to every open stream; keeps them (bounded) while none is open."""

    def __init__(self, backlog: int = BACKLOG_EVENTS) -> None:
        self._lock = threading.Lock()
        self._subscribers: list[queue.Queue[pb.InstanceDone | None]] = []
        self._backlog: deque[pb.InstanceDone] = deque(maxlen=backlog)
        self._closed = False

    def subscribe(self) -> queue.Queue[pb.InstanceDone | None]:
        """A queue of the events (None: the feed closed, the job was unloaded).

        Events that came while no stream was open are handed to the next subscriber.
        """
        q: queue.Queue[pb.InstanceDone | None] = queue.Queue()
        with self._lock:
            for ev in self._backlog:
                q.put(ev)
            self._backlog.clear()
            if self._closed:
                q.put(None)
            else:
                self._subscribers.append(q)
        return q

    def unsubscribe(self, q: queue.Queue[pb.InstanceDone | None]) -> None:
        with self._lock:
            self._subscribers = [s for s in self._subscribers if s is not q]

    def publish(self, ev: pb.InstanceDone) -> None:
        with self._lock:
            if self._subscribers:
                for q in self._subscribers:
                    q.put(ev)
            else:
                self._backlog.append(ev)

    def close(self) -> None:
        """End every stream (each gets None); later subscribers get None at once."""
        with self._lock:
            self._closed = True
            for q in self._subscribers:
                q.put(None)
            self._subscribers.clear()


def drain_events(q: queue.Queue[pb.InstanceDone | None], timeout_s: float,
                 max_batch: int = MAX_BATCH) -> tuple[pb.InstanceDoneBatch, bool]:
    """Wait up to ``timeout_s`` for an event of ``q``, then take every other one it holds (up to ``max_batch``)
    without waiting: one batch, in order, and whether the feed closed (None was read: nothing after it).

    Raises:
        queue.Empty: no event came within ``timeout_s``.
    """
    first = q.get(timeout=timeout_s)
    batch = pb.InstanceDoneBatch()
    ev: pb.InstanceDone | None = first
    while ev is not None:
        batch.done.append(ev)
        if len(batch.done) >= max_batch:
            return batch, False
        try:
            ev = q.get_nowait()
        except queue.Empty:
            return batch, False
    return batch, True
