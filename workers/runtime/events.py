"""A loaded job's event feed: the ``InstanceDone`` events its ``JobEvents`` streams read."""

from __future__ import annotations

import queue
import threading
from collections import deque

from rallypoint.proto import rallypoint_pb2 as pb

BACKLOG_EVENTS = 100_000  # events kept while no JobEvents stream is open


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
