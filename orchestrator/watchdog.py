"""A job's progress watchdog: no progress for a while is a stall, never a silent hang.

The executor tells it of every sign of progress (an instance done, a checkpoint
committed, a recovery restored); :meth:`ProgressWatchdog.check` says, once per
quiet period of ``timeout_s``, that the job stalled and for how long. The executor
then reports ``job.stalled`` with the reason and starts a recovery of the workers it
waits on (:func:`laggards`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from rallypoint.basics.clock import Clock


class ProgressWatchdog:
    def __init__(self, clock: Clock, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"stall timeout must be > 0 s, got {timeout_s}")
        self.clock, self.timeout_s = clock, timeout_s
        self.last = clock.monotonic()
        self.stalls = 0

    def progressed(self) -> None:
        self.last = self.clock.monotonic()

    def check(self) -> float | None:
        """Seconds without progress if that reached the timeout (then re-armed), else None."""
        quiet = self.clock.monotonic() - self.last
        if quiet < self.timeout_s:
            return None
        self.stalls += 1
        self.last = self.clock.monotonic()  # the next report only after another quiet period
        return quiet


def laggards(nodes: Iterable[tuple[str, str]], done_through: Callable[[str], int], worker_of: Mapping[str, str],
             steps: int) -> dict[str, str]:
    """The workers holding the nodes furthest behind, each with why.

    ``nodes``: (node, slice) pairs; ``worker_of``: slice -> worker. A job that is not
    behind anywhere (every node at ``steps``) has none.
    """
    progress = {n: done_through(n) for n, _ in nodes}
    if not progress:
        return {}
    low = min(progress.values())
    if low >= steps:
        return {}
    out: dict[str, str] = {}
    for n, sl in nodes:
        if progress[n] == low and sl in worker_of:
            out.setdefault(worker_of[sl], f"node {n!r} made no progress past step {low}")
    return out
