"""Which lower-priority slices a job takes when it needs devices and none are free. Pure.

Jobs share one pool of workers; each has a priority (higher wins). When a job needs
room for its slices and no worker has it, :func:`plan_preemption` chooses slices of
strictly lower-priority jobs to take (each is then drained off its devices by its own
job, which waits, or shrinks, and takes devices back when they are free), or says why
none will do. The rules, in order:

1. Only strictly lower priorities are taken; equal ones share by arrival (no one is
   preempted for a peer).
2. A needed slice is placed on one worker: its free devices plus the devices of the
   victims taken there must cover the need.
3. Among the ways to place it, the one whose most important victim has the lowest
   priority wins; then the one taking the fewest slices; then the fewest devices;
   then the worker's name and the victims' names (deterministic).
4. Needed slices are placed largest first; what one takes is not offered again.

The planner reserves nothing; the executor asks the victims' jobs to yield
(``yield/<job>/<slice>`` in etcd) and then leases as usual.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations


@dataclass(frozen=True, slots=True, order=True)
class Holding:
    """Slice ``slice`` of ``job`` (priority ``priority``) holds ``devices`` devices of ``worker``."""

    job: str
    slice: str
    worker: str
    devices: int
    priority: int


@dataclass(frozen=True, slots=True)
class Preempt:
    """Take ``victims``; ``places``: needed slice -> the worker it will find room on."""

    victims: tuple[Holding, ...]
    places: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class NoVictims:
    reason: str


def _cost(victims: Sequence[Holding], worker: str) -> tuple[int, int, int, str, tuple[tuple[str, str], ...]]:
    return (max(v.priority for v in victims) if victims else -(2 ** 31), len(victims), sum(v.devices for v in victims),
            worker, tuple(sorted((v.job, v.slice) for v in victims)))


def plan_preemption(need: Mapping[str, int], *, priority: int, free: Mapping[str, int],
                    holdings: Sequence[Holding]) -> Preempt | NoVictims:
    """Victims that make room for every slice of ``need`` (slice -> devices), per the module's rules.

    Args:
        need: the slices without room and the devices each needs.
        priority: the needing job's priority.
        free: eligible worker -> its free devices (workers not listed take nothing).
        holdings: every slice held on those workers, of every job.
    """
    for name, n in need.items():
        if n < 1:
            raise ValueError(f"slice {name!r} needs a positive device count, got {n}")
    left = dict(free)
    taken: set[Holding] = set()
    victims: list[Holding] = []
    places: dict[str, str] = {}
    for name, n in sorted(need.items(), key=lambda kv: (-kv[1], kv[0])):
        best: tuple[tuple[int, int, int, str, tuple[tuple[str, str], ...]], str, tuple[Holding, ...]] | None = None
        for w, room in sorted(left.items()):
            pool = sorted(h for h in holdings if h.worker == w and h.priority < priority and h not in taken)
            for k in range(len(pool) + 1):
                for combo in combinations(pool, k):
                    if room + sum(v.devices for v in combo) < n:
                        continue
                    cost = _cost(combo, w)
                    if best is None or cost < best[0]:
                        best = (cost, w, combo)
        if best is None:
            lower = sum(h.devices for h in holdings if h.priority < priority)
            return NoVictims(f"slice {name!r} needs {n} devices on one worker; no worker has that many free even "
                             f"after taking every slice of lower-priority jobs (they hold {lower} devices in all, "
                             f"priority below {priority})")
        _, w, combo = best
        victims += combo
        taken |= set(combo)
        left[w] = left[w] + sum(v.devices for v in combo) - n
        places[name] = w
    return Preempt(victims=tuple(victims), places=places)
