"""One job's events fanned out to every stream that follows it (``SubmitJob``, ``ResumeJob``, ``WatchJob``).

The executor's ``emit`` ends in :meth:`EventFanOut.publish`, which never blocks the job: each stream
has its own bounded queue (:data:`SUBSCRIBER_QUEUE_MAX` events), and a stream whose client reads too
slowly is dropped with a message (:class:`Subscriber`'s ``dropped``) that :func:`stream_events` sends
it as ``RESOURCE_EXHAUSTED``; the job and the other streams go on. After the job's last event
(``STREAM_END_EVENTS``) nothing more is published, and a stream that subscribes then gets that last
event alone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from rallypoint.orchestrator.job.state import STREAM_END_EVENTS
from rallypoint.proto import rallypoint_pb2 as pb

SUBSCRIBER_QUEUE_MAX = 256  # events a stream may fall behind the job before it is dropped (the job never waits)


class Subscriber(queue.Queue[pb.JobEvent]):
    """One stream's events, bounded; ``dropped`` says why it was cut off (it fell too far behind)."""

    def __init__(self) -> None:
        super().__init__(maxsize=SUBSCRIBER_QUEUE_MAX)
        self.dropped = ""


class EventFanOut:
    """The streams that follow job ``job`` and its last event, once it ended (thread-safe)."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.subscribers: list[queue.Queue[pb.JobEvent]] = []
        self.last: pb.JobEvent | None = None  # the executor's last event, once it ended
        self._lock = threading.Lock()

    def publish(self, ev: pb.JobEvent) -> None:
        """Every subscriber gets every event. It never blocks: a subscriber whose queue is full (its
        client reads too slowly) is dropped, not waited for."""
        with self._lock:
            if self.last is not None:
                return  # nothing after the end
            if ev.event in STREAM_END_EVENTS:
                self.last = ev
            subs = list(self.subscribers)
        for q in subs:
            try:
                q.put_nowait(ev)
            except queue.Full:
                self._drop(q, ev)

    def _drop(self, q: queue.Queue[pb.JobEvent], ev: pb.JobEvent) -> None:
        self.unsubscribe(q)
        if isinstance(q, Subscriber):
            q.dropped = (f"this stream fell {q.maxsize} events behind job {self.job!r} (at {ev.event} step {ev.step}) "
                         "and was dropped; the job goes on: follow it again with WatchJob")

    def subscribe(self) -> queue.Queue[pb.JobEvent]:
        q = Subscriber()
        with self._lock:
            if self.last is not None:
                q.put(self.last)
            else:
                self.subscribers.append(q)
        return q

    def unsubscribe(self, q: queue.Queue[pb.JobEvent]) -> None:
        with self._lock:
            if q in self.subscribers:
                self.subscribers.remove(q)


def stream_events(events: EventFanOut, q: queue.Queue[pb.JobEvent], context: grpc.ServicerContext,
                  log: Any) -> Iterator[pb.JobEvent]:
    """The job's events from ``q`` (subscribed to ``events``) until its last one, or until the client goes away."""
    try:
        while True:
            dropped = getattr(q, "dropped", "")
            if dropped:  # it fell too far behind: the client hears why, the job goes on
                log.warning("watch.dropped", job=events.job, reason=dropped)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, dropped)
            try:
                ev = q.get(timeout=0.5)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            yield ev
            if ev.event in STREAM_END_EVENTS:
                return
    finally:
        events.unsubscribe(q)
