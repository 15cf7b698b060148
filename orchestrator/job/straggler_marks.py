"""The straggler watch's bookkeeping of its oldest marks (:class:`~rallypoint.orchestrator.job.stragglers.StragglerWatch`).

The watch drops its marks of steps it measured, and the work intervals no span still measured overlaps, after
every event it hears. :class:`Marks` keeps, as the marks come, what makes that drop cost nothing when there is
nothing to drop, instead of a scan of every slice's marks per event (the leader's cost per instance stays flat as
the job's slices grow, ``bench/leader_scale.py``): the lowest step of the ``(step, slice)`` marks, the earliest
start of each step's spans, and the order the slices' work ended in (the clock's, which never goes back; a clock
that did makes it scan every slice, as before).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

NEVER = 2 ** 62  # no mark held


class Marks:
    """See the module doc. Single-threaded: the executor's loop calls the watch."""

    def __init__(self) -> None:
        self.low = NEVER  # no (step, slice) mark (slice_done, heard_in) below this step
        self.low_save = NEVER  # no save mark (save_s, by its checkpoint step) below this step
        self.span_low: dict[int, float] = {}  # step -> the earliest start of its spans
        self.ended: deque[tuple[float, str]] = deque()  # (end, slice) of every work interval held, in order
        self.in_order = True  # the ends came in order (False: a clock went back; drop_work scans every slice)

    def span(self, step: int, ready: float) -> None:
        """A span of ``step`` starting at ``ready`` was measured."""
        self.span_low[step] = min(ready, self.span_low.get(step, ready))

    def worked(self, slice_name: str, end: float) -> None:
        """A work interval of ``slice_name`` ending at ``end`` was noted (after every one before it)."""
        if not self.in_order:
            return
        if self.ended and end < self.ended[-1][0]:
            self.in_order, self.ended = False, deque()
            return
        self.ended.append((end, slice_name))

    def oldest(self, now: float) -> float:
        """The earliest start of any span held (``now`` when none is)."""
        return min(self.span_low.values(), default=now)

    def drop_old(self, by_step: Iterable[dict[tuple[int, str], object]], keep_from: int,
                 saves: dict[tuple[int, str], float], keep_saves_from: int) -> None:
        """Drop the marks of ``by_step`` below ``keep_from`` and of ``saves`` below ``keep_saves_from`` (keys
        ``(step, slice)``): a scan only when one is that old."""
        if self.low < keep_from:
            low = NEVER
            for marks in by_step:
                for old in [k for k in marks if k[0] < keep_from]:
                    del marks[old]
                low = min(low, min((k[0] for k in marks), default=NEVER))
            self.low = low
        if self.low_save < keep_saves_from:
            for old in [k for k in saves if k[0] < keep_saves_from]:
                del saves[old]
            self.low_save = min((k[0] for k in saves), default=NEVER)

    def drop_work(self, work: dict[str, list[tuple[float, float]]], oldest: float) -> None:
        """Drop every work interval that ended at or before ``oldest``: each slice's oldest ones, the ends being
        in order (a clock that went back: every slice's list is filtered)."""
        if not self.in_order:
            for s, xs in work.items():
                work[s] = [x for x in xs if x[1] > oldest]
            return
        gone: dict[str, int] = {}
        while self.ended and self.ended[0][0] <= oldest:
            s = self.ended.popleft()[1]
            gone[s] = gone.get(s, 0) + 1
        for s, n in gone.items():
            del work[s][:n]
