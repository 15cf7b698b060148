"""The injected clocks: the fake one's wall time moves with its monotonic time, and only when told to."""

from __future__ import annotations

import threading
import time

from rallypoint.basics.clock import SYSTEM_CLOCK, FakeClock


def test_a_fake_clock_s_wall_time_moves_with_its_monotonic_time_and_only_then() -> None:
    clock = FakeClock(start=50.0, wall_start=1_000.0)
    assert clock.monotonic() == 50.0 and clock.wall() == 1_000.0
    clock.advance(2.5)
    assert clock.monotonic() == 52.5 and clock.wall() == 1_002.5
    clock.sleep(10.0)  # instant: the clock moves, no real time passes
    assert clock.wall() == 1_012.5
    assert not clock.wait(threading.Event(), 7.5) and clock.wall() == 1_020.0
    set_already = threading.Event()
    set_already.set()
    assert clock.wait(set_already, 100.0) and clock.wall() == 1_020.0  # a set event: no time passes


def test_a_fake_clock_s_wall_time_starts_at_the_real_one_unless_given() -> None:
    before = time.time()
    wall = FakeClock().wall()
    assert before <= wall <= time.time()


def test_the_system_clock_s_wall_time_is_the_real_one() -> None:
    before = time.time()
    assert before <= SYSTEM_CLOCK.wall() <= time.time()
