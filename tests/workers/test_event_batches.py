"""A JobEvents stream's batches (workers/runtime/events.py): what is ready goes in one message, in order."""

from __future__ import annotations

import queue

import pytest

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.runtime.events import EventFeed, drain_events


def done(step: int) -> pb.InstanceDone:
    return pb.InstanceDone(node="fwd", step=step, microbatch=-1, compute_s=0.01)


def test_every_ready_event_goes_in_one_batch_in_order_and_round_trips_on_the_wire() -> None:
    feed = EventFeed()
    q = feed.subscribe()
    for s in range(5):
        feed.publish(done(s))
    batch, ended = drain_events(q, timeout_s=0.0)
    assert not ended and [d.step for d in batch.done] == [0, 1, 2, 3, 4]
    wire = pb.InstanceDoneBatch.FromString(batch.SerializeToString())
    assert list(wire.done) == list(batch.done)
    with pytest.raises(queue.Empty):  # nothing left: the stream waits for the next
        drain_events(q, timeout_s=0.0)


def test_a_batch_is_bounded_and_the_rest_follows_in_the_next() -> None:
    feed = EventFeed()
    q = feed.subscribe()
    for s in range(7):
        feed.publish(done(s))
    first, _ = drain_events(q, timeout_s=0.0, max_batch=4)
    second, _ = drain_events(q, timeout_s=0.0, max_batch=4)
    assert [d.step for d in first.done] == [0, 1, 2, 3] and [d.step for d in second.done] == [4, 5, 6]


def test_the_feed_closing_ends_the_stream_after_what_came_before_it() -> None:
    feed = EventFeed()
    q = feed.subscribe()
    feed.publish(done(0))
    feed.publish(pb.InstanceDone(error="boom"))  # a failure: sent like any event, in its place
    feed.close()
    batch, ended = drain_events(q, timeout_s=0.0)
    assert ended and [d.error for d in batch.done] == ["", "boom"]
    late = feed.subscribe()  # a stream opened after the close ends at once, with nothing
    empty, ended = drain_events(late, timeout_s=0.0)
    assert ended and len(empty.done) == 0
