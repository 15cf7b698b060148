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


def test_after_a_pause_of_the_whole_process_nobody_is_silent_until_the_readers_had_time_to_catch_up(
        coordinator: tuple[Coordinator, FakeClock]) -> None:
    c, clock = coordinator
    tick(c, clock, 0.4, beating=("w0", "w1"))
    clock.advance(3.0)  # the coordinator itself stopped (no tick either): heartbeats wait unread
    c._check_silence()
    assert suspects(c) == []
    tick(c, clock, 0.4, beating=("w0",))  # w0's waiting heartbeats are read; the grace is half the limit
    assert suspects(c) == []
    tick(c, clock, 0.2, beating=("w0",))  # ... and past it, w1's silence (since before the pause) is real
    assert suspects(c) == [("w1", "silent")]


def test_a_leader_loop_busy_while_the_process_runs_suspects_a_silent_worker_at_its_next_look(
        coordinator: tuple[Coordinator, FakeClock]) -> None:
    c, clock = coordinator
    tick(c, clock, 0.4, beating=("w0", "w1"))
    assert c.silence is not None
    for _ in range(8):  # the loop waits 1.6 s on etcd; the ticker and w0's reader run meanwhile
        clock.advance(0.2)
        c.silence.tick()
        c._links["w0"].heard_at = clock.monotonic()
    c._check_silence()
    assert suspects(c) == [("w1", "silent")]  # quiet 1.6 s: not counted again from the busy loop's look
    assert c.silence.pauses == 0


def test_a_silent_worker_is_told_to_the_jobs_before_the_leader_fences_it(
        coordinator: tuple[Coordinator, FakeClock]) -> None:
    c, clock = coordinator
    told: list[tuple[str, int, str]] = []
    c.add_fence_listener(lambda w, inc, why: told.append((w, inc, why)))
    tick(c, clock, 1.2, beating=("w0",))
    assert [(w, inc) for w, inc, _ in told] == [("w1", 7)] and told[0][2].startswith("silent: no heartbeat")
    assert suspects(c) == [("w1", "silent")]  # the fence itself follows on the leader's loop


def test_zero_turns_the_silence_check_off() -> None:
    clock = FakeClock()
    c = Coordinator(CoordinatorConfig(cluster="t", coordinator_id="c0", endpoints=("127.0.0.1:1",), suspect_after_s=0),
                    store=MemoryStore(), clock=clock)
    info = WorkerInfo("w0", 7, 1, "127.0.0.1:1", 1, 1, "serving", {})
    c._links["w0"] = c.link(info, term=1)
    try:
        tick(c, clock, 5.0)
        assert c.silence is None and suspects(c) == []
    finally:
        c._links["w0"].stop()


@pytest.mark.parametrize("limit", [0.1, 0.29])
def test_a_limit_under_three_heartbeats_is_refused(limit: float) -> None:
    with pytest.raises(ConfigError, match="at least three heartbeat periods"):
        CoordinatorConfig(cluster="t", coordinator_id="c0", endpoints=("127.0.0.1:1",), suspect_after_s=limit)
