"""orchestrator/job/watchdog.py: stalls are reported once per quiet period; recovery/stalls.py: the laggards
are who the job waits on."""

from __future__ import annotations

import pytest

from rallypoint.basics.clock import FakeClock
from rallypoint.orchestrator.job.watchdog import ProgressWatchdog
from rallypoint.recovery.stalls import laggards


def test_a_stall_is_reported_once_per_quiet_period_and_progress_rearms_it() -> None:
    clock = FakeClock()
    w = ProgressWatchdog(clock, 10.0)
    clock.advance(9.9)
    assert w.check() is None
    clock.advance(0.2)
    assert w.check() == pytest.approx(10.1) and w.stalls == 1
    assert w.check() is None  # not again until another quiet period
    clock.advance(5)
    w.progressed()
    clock.advance(9)
    assert w.check() is None and w.stalls == 1
    clock.advance(1.01)
    assert w.check() == pytest.approx(10.01) and w.stalls == 2
    with pytest.raises(ValueError, match="stall timeout must be > 0"):
        ProgressWatchdog(clock, 0)


def test_laggards_are_the_workers_of_the_nodes_furthest_behind() -> None:
    progress = {"a": 5, "b": 3, "c": 3, "d": 9}
    nodes = [("a", "s0"), ("b", "s1"), ("c", "s2"), ("d", "s3")]
    out = laggards(nodes, progress.__getitem__, {"s0": "w0", "s1": "w1", "s2": "w1", "s3": "w3"}, steps=10)
    assert out == {"w1": "node 'b' made no progress past step 3"}
    assert laggards(nodes, lambda n: 10, {"s0": "w0"}, steps=10) == {}


def test_stalls_are_counted_per_window_not_per_lifetime() -> None:
    clock = FakeClock()
    w = ProgressWatchdog(clock, 10.0, window_s=100.0)
    for _ in range(3):
        clock.advance(10)
        assert w.check() is not None
    assert w.stalls == 3
    clock.advance(75)  # the first stall was 95 s ago, the others 85 and 75
    assert w.stalls == 3
    clock.advance(10)
    assert w.stalls == 2


def test_no_stall_while_a_node_waited_on_compiles_until_the_compile_timeout() -> None:
    clock = FakeClock()
    w = ProgressWatchdog(clock, 10.0, compile_timeout_s=300.0)
    runtime = {"a": ("w0", 1), "b": ("w1", 1)}
    assert w.compiling(runtime, runtime.get)  # nothing has run yet: both compile at their first call
    w.ran("a", ("w0", 1))
    assert w.compiling(runtime, runtime.get)
    clock.advance(299)
    assert w.check(compiling=True) is None
    clock.advance(1)
    assert w.check(compiling=True) == pytest.approx(300) and w.stalls == 1  # a hang while compiling is still seen
    w.ran("b", ("w1", 1))
    assert not w.compiling(runtime, runtime.get)
    assert w.compiling({"b": ("w2", 2)}, {"b": ("w2", 2)}.get)  # moved to another runtime: it compiles again there
    clock.advance(10)
    assert w.check(compiling=False) == pytest.approx(10)
