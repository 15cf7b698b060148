"""The leader's silence check (hang detection under the lease TTL), on a fake clock: no processes."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import pytest

from rallypoint.basics.clock import FakeClock
from rallypoint.etcd.cluster_view import WorkerInfo
from rallypoint.basics.errors import ConfigError
from rallypoint.orchestrator.service.coordinator import Coordinator, CoordinatorConfig
from tests.fakes import MemoryStore

LIMIT = 1.0


@pytest.fixture
def coordinator() -> Iterator[tuple[Coordinator, FakeClock]]:
    clock = FakeClock()
    c = Coordinator(CoordinatorConfig(cluster="t", coordinator_id="c0", endpoints=("127.0.0.1:1",),
                                      suspect_after_s=LIMIT), store=MemoryStore(), clock=clock)
    for w in ("w0", "w1"):
        info = WorkerInfo(w, 7, 1, "127.0.0.1:1", 1, 1, "serving", {})
        c._links[w] = c.link(info, term=1)  # not started: the test plays its heartbeats
    try:
        yield c, clock
    finally:
        for link in c._links.values():
            link.stop()


def suspects(c: Coordinator) -> list[tuple[str, str]]:
    out = []
    while True:
        try:
            kind, payload = c._events.get_nowait()
        except queue.Empty:
            return out
        assert kind == "suspect"
        out.append((payload[0].worker, payload[1]))


def tick(c: Coordinator, clock: FakeClock, seconds: float, *, beating: tuple[str, ...] = ()) -> None:
    """Run the leader loop's check every 0.2 s for ``seconds``; the ``beating`` workers send heartbeats."""
    for _ in range(round(seconds / 0.2)):
        clock.advance(0.2)
        for w in beating:
            c._links[w].heard_at = clock.monotonic()
        c._check_silence()


def test_a_worker_silent_past_the_limit_is_suspected_once_and_a_beating_one_never(
        coordinator: tuple[Coordinator, FakeClock]) -> None:
    c, clock = coordinator
    tick(c, clock, 0.8, beating=("w0", "w1"))
    assert suspects(c) == []
    tick(c, clock, 0.8, beating=("w0",))  # w1 silent for 0.8 s: not yet
    assert suspects(c) == []
    tick(c, clock, 0.4, beating=("w0",))
    assert suspects(c) == [("w1", "silent")]
    tick(c, clock, 3.0, beating=("w0",))
    assert suspects(c) == []  # reported once; fencing it is the leader's next step


def test_a_leader_loop_held_up_past_half_the_limit_counts_nobody_silent(
        coordinator: tuple[Coordinator, FakeClock]) -> None:
    c, clock = coordinator
    tick(c, clock, 0.4, beating=("w0", "w1"))
    clock.advance(3.0)  # the coordinator itself stopped: heartbeats wait unread
    c._check_silence()
    assert suspects(c) == []
    tick(c, clock, 0.8)  # from here the silence counts again ...
    assert suspects(c) == []
    tick(c, clock, 0.4)  # ... and past the limit it is real
    assert sorted(suspects(c)) == [("w0", "silent"), ("w1", "silent")]


def test_zero_turns_the_silence_check_off(coordinator: tuple[Coordinator, FakeClock]) -> None:
    c, clock = coordinator
    c.config = CoordinatorConfig(cluster="t", coordinator_id="c0", endpoints=("127.0.0.1:1",), suspect_after_s=0)
    tick(c, clock, 5.0)
    assert suspects(c) == []


@pytest.mark.parametrize("limit", [0.1, 0.29])
def test_a_limit_under_three_heartbeats_is_refused(limit: float) -> None:
    with pytest.raises(ConfigError, match="at least three heartbeat periods"):
        CoordinatorConfig(cluster="t", coordinator_id="c0", endpoints=("127.0.0.1:1",), suspect_after_s=limit)
