"""A job's event fan-out: bounded per-stream queues; a slow stream is dropped with a message, never the job.

Pure logic: :class:`~rallypoint.orchestrator.service.fanout.EventFanOut` and the service's stream loop
(:func:`~rallypoint.orchestrator.service.fanout.stream_events`) with a stand-in gRPC context (the 100-watcher
test against a real coordinator server is in tests/integration/test_watchers.py).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import grpc
import pytest

from rallypoint.orchestrator.service import fanout
from rallypoint.proto import rallypoint_pb2 as pb


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Context:
    def is_active(self) -> bool:
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


QUIET = SimpleNamespace(warning=lambda *a, **k: None)  # the service's logger


def test_a_stream_that_falls_behind_is_dropped_with_a_message_and_the_job_and_the_others_go_on() -> None:
    run = fanout.EventFanOut("j")
    slow, fast = run.subscribe(), run.subscribe()
    total = 3 * fanout.SUBSCRIBER_QUEUE_MAX
    seen: list[pb.JobEvent] = []
    reader = threading.Thread(target=lambda: seen.extend(fanout.stream_events(run, fast, Context(), QUIET)),
                              daemon=True)
    reader.start()
    batch = fanout.SUBSCRIBER_QUEUE_MAX // 2

    def job() -> None:  # the executor's emits, paced as a job would be: the reading stream keeps up
        for i in range(total):
            run.publish(pb.JobEvent(job="j", event="job.progress", step=i))
            if i % batch == batch - 1:
                drained.wait(10)
                drained.clear()
        run.publish(pb.JobEvent(job="j", event="job.finished", step=total))

    drained = threading.Event()
    published = threading.Thread(target=job, daemon=True)
    published.start()
    while published.is_alive():
        if fast.empty():
            drained.set()
        published.join(0.005)
    reader.join(10)
    assert [e.step for e in seen] == list(range(total)) + [total], "the stream that kept up lost events"
    assert slow.qsize() <= fanout.SUBSCRIBER_QUEUE_MAX, "a slow stream's queue grew without bound"
    assert slow not in run.subscribers
    with pytest.raises(Aborted) as aborted:
        list(fanout.stream_events(run, slow, Context(), QUIET))
    assert aborted.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "fell" in aborted.value.details and "behind" in aborted.value.details and "follow it again" in \
        aborted.value.details
