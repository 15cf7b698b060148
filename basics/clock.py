"""Injectable clocks, so lease, heartbeat and timeout logic is tested without waiting."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """A monotonic clock that can also wait, and tell the wall time."""

    def monotonic(self) -> float:
        """Seconds on a monotonic scale (never goes back)."""

    def wall(self) -> float:
        """Seconds since the epoch (``time.time()``): what records and events stamp, and ages are read from."""

    def sleep(self, seconds: float) -> None:
        """Block for ``seconds`` of this clock's time."""

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``event``; return whether it is set."""


class SystemClock:
    """The real clocks: monotonic and wall."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(max(0.0, seconds))


class FakeClock:
    """A clock that only moves when told to (``advance``), or when something sleeps on it.

    ``sleep`` advances the clock instantly, so a loop driven by this clock runs its
    iterations without real waiting. Its wall time moves with its monotonic time, from
    ``wall_start`` (default: the real wall time when the clock was made).
    """

    def __init__(self, start: float = 1000.0, *, wall_start: float | None = None) -> None:
        self._now = start
        self._wall_offset = (time.time() if wall_start is None else wall_start) - start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def wall(self) -> float:
        with self._lock:
            return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``."""
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        with self._lock:
            self._now += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    def wait(self, event: threading.Event, seconds: float) -> bool:
        if event.is_set():
            return True
        self.advance(max(0.0, seconds))
        return event.is_set()


SYSTEM_CLOCK = SystemClock()
