"""A job's progress watchdog: no progress for a while is a stall, never a silent hang.

The executor tells it of every sign of progress (an instance done, a checkpoint
committed, a recovery restored); :meth:`ProgressWatchdog.check` says, once per
quiet period of ``timeout_s``, that the job stalled and for how long. The executor
then reports ``job.stalled`` with the reason and starts a recovery of the workers it
waits on (:func:`rallypoint.recovery.stalls.laggards`).

A node that has not yet run once on its current runtime compiles at its first call
(minutes, for a large model): while a node the job waits on
(:func:`rallypoint.recovery.stalls.lagging_nodes`)
has not, the quiet period may last ``compile_timeout_s`` instead (:meth:`ProgressWatchdog.compiling`),
so a healthy worker that compiles is not fenced. Stalls are counted per sliding window
of ``window_s`` (:attr:`ProgressWatchdog.stalls`), not per lifetime: a long job is not
failed for a few stalls far apart.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

from rallypoint.basics.clock import Clock

DEFAULT_COMPILE_TIMEOUT_S = 1800.0
DEFAULT_STALL_WINDOW_S = 3600.0


class ProgressWatchdog:
    def __init__(self, clock: Clock, timeout_s: float, *, compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 window_s: float = DEFAULT_STALL_WINDOW_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"stall timeout must be > 0 s, got {timeout_s}")
        self.clock, self.timeout_s = clock, timeout_s
        self.compile_timeout_s, self.window_s = max(compile_timeout_s, timeout_s), window_s
        self.last = clock.monotonic()
        self._stalls: list[float] = []  # when each stall was reported
        self._ran: dict[str, Hashable] = {}  # node -> the runtime it last ran an instance on

    @property
    def stalls(self) -> int:
        """Stalls reported in the last ``window_s``."""
        now = self.clock.monotonic()
        self._stalls = [t for t in self._stalls if t > now - self.window_s]
        return len(self._stalls)

    def progressed(self) -> None:
        self.last = self.clock.monotonic()

    def ran(self, node: str, runtime: Hashable) -> None:
        """``node`` ran an instance on ``runtime`` (a worker and its generation): it is compiled there."""
        self._ran[node] = runtime

    def compiling(self, nodes: Iterable[str], runtime_of: Callable[[str], Hashable | None]) -> bool:
        """Whether one of ``nodes`` (those the job waits on) has not yet run on its current runtime."""
        return any((rt := runtime_of(n)) is not None and self._ran.get(n) != rt for n in nodes)

    def check(self, compiling: bool = False) -> float | None:
        """Seconds without progress if that reached the timeout (then re-armed), else None.

        ``compiling``: a node the job waits on compiles (:meth:`compiling`): the timeout is ``compile_timeout_s``.
        """
        quiet = self.clock.monotonic() - self.last
        if quiet < (self.compile_timeout_s if compiling else self.timeout_s):
            return None
        self._stalls.append(self.clock.monotonic())
        self.last = self.clock.monotonic()  # the next report only after another quiet period
        return quiet
