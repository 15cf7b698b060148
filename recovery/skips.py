"""The batches a run skips: a remap of its steps onto later positions of its sources' streams. Pure.

Every source of a job is a function of a stream position: ``source(position, microbatch)``. Without
skips the position is the step. A rolled-back loss spike (docs/integrity.md) skips the batches of
the steps around it: their positions are never read again, and every later step reads the next
position not skipped. :class:`Skips` holds the skipped ranges of positions, merged and sorted, and
maps a step to its position (:meth:`Skips.position`). The list is part of the run (the job record
keeps it, every load carries it, ``rallypoint run --reference --skip`` takes it), so a replay, a
resume, an adoption and a reference all read the same batches.

A source that is a clock (``Program.source(..., clock=True)``, as :meth:`Program.from_step` makes
for the step a train step asks for) gives the step itself and is never remapped: a learning-rate
schedule goes on from the step, whatever data was skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_SKIPS = 1024  # ranges a run may hold (each rollback adds at most one): a record or a request with more is refused


@dataclass(frozen=True, order=True)
class SkipRange:
    """Stream positions ``start .. start + count - 1``, never read."""

    start: int
    count: int

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"a skipped range starts at a position >= 0, got {self.start!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"a skipped range holds >= 1 position, got {self.count!r}")

    @property
    def end(self) -> int:
        return self.start + self.count

    def to_json(self) -> list[int]:
        return [self.start, self.count]

    def __str__(self) -> str:
        return f"{self.start}:{self.count}"


@dataclass(frozen=True)
class Skips:
    """The skipped ranges of a run's streams, sorted, merged, none touching another."""

    ranges: tuple[SkipRange, ...] = ()

    def __post_init__(self) -> None:
        if len(self.ranges) > MAX_SKIPS:
            raise ValueError(f"{len(self.ranges)} skipped ranges, over the {MAX_SKIPS} a run may hold")
        for a, b in zip(self.ranges, self.ranges[1:]):
            if b.start <= a.end:
                raise ValueError(f"skipped ranges {a} and {b} are not sorted and apart")

    @classmethod
    def of(cls, ranges: Iterable[SkipRange]) -> Skips:
        """The union of ``ranges`` (overlapping or touching ones merged)."""
        merged: list[SkipRange] = []
        for r in sorted(ranges):
            if merged and r.start <= merged[-1].end:
                last = merged.pop()
                r = SkipRange(last.start, max(last.end, r.end) - last.start)
            merged.append(r)
        return cls(tuple(merged))

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def position(self, step: int) -> int:
        """The stream position ``step`` reads: the ``step``-th position (from 0) that is not skipped."""
        p = int(step)
        for r in self.ranges:
            if r.start > p:
                break
            p += r.count
        return p

    def skipping(self, first: int, last: int) -> Skips:
        """These skips and the positions steps ``first .. last - 1`` read now: from ``first`` on, steps read the
        positions after the one step ``last - 1`` reads (steps before ``first`` read what they read)."""
        if not 0 <= first < last:
            raise ValueError(f"a skip covers steps first .. last-1 with 0 <= first < last, got {first}, {last}")
        start, end = self.position(first), self.position(last - 1) + 1
        return Skips.of([*self.ranges, SkipRange(start, end - start)])

    def to_json(self) -> list[list[int]]:
        return [r.to_json() for r in self.ranges]

    @classmethod
    def from_json(cls, value: Any) -> Skips:
        """From :meth:`to_json`'s form (a job record's ``skips``). Raises ValueError naming what is wrong."""
        if value is None:
            return cls()
        if not isinstance(value, list) or len(value) > MAX_SKIPS:
            raise ValueError(f"skips must be a list of at most {MAX_SKIPS} [start, count] pairs, got {value!r:.80}")
        out = []
        for r in value:
            if not isinstance(r, list) or len(r) != 2:
                raise ValueError(f"a skipped range is a [start, count] pair, got {r!r:.80}")
            out.append(SkipRange(r[0], r[1]))
        return cls.of(out)

    @classmethod
    def parse(cls, texts: Sequence[str]) -> Skips:
        """From ``START:COUNT`` texts (``rallypoint run --reference --skip``). Raises ValueError naming the text."""
        out = []
        for t in texts:
            start, sep, count = str(t).partition(":")
            try:
                if not sep:
                    raise ValueError("no ':'")
                out.append(SkipRange(int(start), int(count)))
            except ValueError as exc:
                raise ValueError(f"skip {t!r} is not START:COUNT (stream positions, START >= 0, COUNT >= 1): "
                                 f"{exc}") from None
        return cls.of(out)

    def to_proto(self, into: Any) -> None:
        """Append the ranges to a repeated ``SkipRange`` field (``LoadJobRequest.skips``)."""
        for r in self.ranges:
            into.add(start=r.start, count=r.count)

    @classmethod
    def from_proto(cls, ranges: Iterable[Any]) -> Skips:
        """From a repeated ``SkipRange`` field. Raises ValueError naming what is wrong (a request refused)."""
        got = list(ranges)
        if len(got) > MAX_SKIPS:
            raise ValueError(f"{len(got)} skipped ranges, over the {MAX_SKIPS} a run may hold")
        return cls.of(SkipRange(int(r.start), int(r.count)) for r in got)

    def __str__(self) -> str:
        return ",".join(map(str, self.ranges)) or "none"

