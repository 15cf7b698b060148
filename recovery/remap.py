"""The remap policy: which spare devices take over each lost virtual slice. Pure.

The controller carries out decisions; this module makes them (STYLE.md item 2).
:func:`plan_remap` takes a :class:`~rallypoint.etcd.cluster_view.ClusterSnapshot` (plain
data read at one revision), the lost slices with the device count each needs, and
a :class:`RemapPolicy`, and returns one of:

* :class:`Remap`: every lost slice gets devices of its full count;
* :class:`Wait`: some slice finds no room; wait (up to ``wait_timeout_s``) for a
  worker to join, then decide again;
* :class:`Shrink`: restore the slices that find no room onto fewer devices;
* :class:`NoRoom`: no remap is possible under the policy: the job fails, with a reason
  naming the slice, the devices it needs, the most free on one worker, and the setting
  to change (a recovery's own giving up is :class:`rallypoint.recovery.decide.Fail`).

It reserves nothing: the controller leases the chosen devices with the usual
compare-and-swap transaction and asks again (with a fresh snapshot) if it loses
a race.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # plain data only; recovery/ does no I/O
    from rallypoint.etcd.cluster_records import ClusterSnapshot, WorkerSnapshot

OnNoSpare = Literal["wait", "shrink", "fail"]
ON_NO_SPARE: tuple[OnNoSpare, ...] = ("wait", "shrink", "fail")


@dataclass(frozen=True, slots=True, kw_only=True)
class RemapPolicy:
    """What to do when a lost slice finds no worker with room for it.

    Args:
        on_no_spare: ``"wait"`` for a worker to join (up to ``wait_timeout_s``,
            then fail), ``"shrink"`` to restore onto fewer devices (results then
            match the reference only to a tolerance), or ``"fail"`` the job.
        wait_timeout_s: how long ``"wait"`` waits, in seconds.

    Raises:
        ValueError: an unknown ``on_no_spare`` or a negative or non-finite timeout.
    """

    on_no_spare: OnNoSpare = "wait"
    wait_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.on_no_spare not in ON_NO_SPARE:
            raise ValueError(f"on_no_spare must be one of {list(ON_NO_SPARE)}, got {self.on_no_spare!r}")
        t = self.wait_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"wait_timeout_s must be a finite number of seconds >= 0, got {t!r}")


@dataclass(frozen=True, slots=True)
class Assignment:
    """Lost ``slice`` (which had ``needed`` devices) moves to ``devices`` of ``worker``."""

    slice: str
    worker: str
    devices: tuple[int, ...]
    needed: int

    @property
    def shrunk(self) -> bool:
        """Fewer devices than the slice had."""
        return len(self.devices) < self.needed


@dataclass(frozen=True, slots=True, kw_only=True)
class Remap:
    """Every lost slice gets devices of its full count (in placement order: largest slice first)."""

    assignments: tuple[Assignment, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Wait:
    """Some slices find no room (``missing``: slice -> devices needed); decide again when a worker joins."""

    missing: Mapping[str, int]
    timeout_s: float
    waited_s: float
    largest_free: int

    @property
    def remaining_s(self) -> float:
        """How much longer to wait before asking again with ``waited_s`` past the timeout (it then fails)."""
        return max(0.0, self.timeout_s - self.waited_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shrink:
    """Every lost slice gets devices, some fewer than they had.

    A shrunk slice restores its checkpoint onto the new device count (Orbax
    restore with new shardings) and runs on a smaller mesh: XLA then reduces in
    another order, so the job's results match the fault-free reference only to a
    floating-point tolerance, not bitwise. The count chosen divides the old one,
    so a dimension that was split evenly stays split evenly.
    """

    assignments: tuple[Assignment, ...]

    @property
    def shrunk(self) -> dict[str, int]:
        """Shrunk slice -> its new device count."""
        return {a.slice: len(a.devices) for a in self.assignments if a.shrunk}


@dataclass(frozen=True, slots=True, kw_only=True)
class NoRoom:
    """No remap is possible under the policy; ``reason`` says why and what to change."""

    reason: str
    missing: Mapping[str, int] = field(default_factory=dict)


RemapDecision = Remap | Wait | Shrink | NoRoom


def eligible(
    name: str, worker: WorkerSnapshot, snapshot: ClusterSnapshot, exclude: frozenset[str] = frozenset(),
    lost: Mapping[str, int] = MappingProxyType({}),
) -> bool:
    """Whether ``worker`` may take a lost slice: live, uncordoned, not leaving, not this incarnation lost.

    ``exclude`` names workers unusable whatever their incarnation; ``lost`` maps a worker to the
    incarnation a recovery lost: that one and any older are unusable, a newer one (the worker
    registered again: restarted, or back from a partition) is a worker like any other.
    """
    if name in exclude or worker.cordoned or name in snapshot.cordoned or worker.info.state == "leaving":
        return False
    if name in lost and worker.info.incarnation <= lost[name]:
        return False
    loss = snapshot.lost.get(name)
    # A lost record names the incarnation it is about; a worker that registered again since is a new one.
    return loss is None or loss.get("incarnation") not in (None, worker.info.incarnation)


def plan_remap(
    snapshot: ClusterSnapshot, lost: Mapping[str, int], policy: RemapPolicy, *,
    exclude: frozenset[str] = frozenset(), waited_s: float = 0.0, allowed: Mapping[str, Sequence[int]] | None = None,
    lost_incarnations: Mapping[str, int] = MappingProxyType({}),
) -> RemapDecision:
    """Choose devices for each lost slice, or decide per ``policy`` what to do without them.

    Slices are placed largest first (then by name), each on one eligible worker
    (see :func:`eligible`) on free devices no other slice of this decision takes,
    the lowest indices first. Workers that were whole spares in ``snapshot`` come
    first, tightest fit among them (so the slices of one lost host land together
    on one replacement host), then the name; a worker partly leased to another job
    is used only when no such spare has room.

    Unlike :func:`rallypoint.orchestrator.control.devices.choose_devices`, which packs new jobs onto
    partly leased workers to keep spares whole, recovery replaces a lost host by
    spare hosts: packing a recovered slice beside another job's slices would tie
    their failures together and take the room that job may need to grow or recover
    in, while the spare pool exists for exactly this.

    Placement is greedy (first fit decreasing): when no eligible worker has room
    for the largest remaining slice it is missing, even if some other packing of
    all the slices existed; with whole-host spares this does not arise.

    Args:
        snapshot: workers, devices, leases, cordons and losses at one revision.
        lost: lost slice -> devices it needs.
        policy: what to do when a slice finds no room.
        exclude: workers unusable whatever their incarnation (the job's own runtimes).
        lost_incarnations: worker -> the incarnation a recovery lost and fenced, which ``snapshot`` may
            not show as gone yet; a newer incarnation of that worker is eligible (see :func:`eligible`).
        waited_s: how long recovery has already waited for room (policy ``"wait"``).
        allowed: slice -> the device counts it can run on (its programs were exported for
            them, ``devices=(min, max)``); a slice missing here shrinks to any divisor of its count.

    Raises:
        ValueError: a device count below 1.
    """
    for name, need in lost.items():
        if isinstance(need, bool) or not isinstance(need, int) or need < 1:
            raise ValueError(f"lost slice {name!r} needs a positive device count, got {need!r}")
    workers = {w: s for w, s in snapshot.workers.items() if eligible(w, s, snapshot, exclude, lost_incarnations)}
    free = {w: sorted(s.free) for w, s in workers.items()}
    spare = {w for w, s in workers.items() if not s.holders}
    placed: list[Assignment] = []
    missing: dict[str, int] = {}
    for name, need in sorted(lost.items(), key=lambda kv: (-kv[1], kv[0])):
        fits = [w for w in workers if len(free[w]) >= need]
        if not fits:
            missing[name] = need
            continue
        w = min(fits, key=lambda w: (w not in spare, len(free[w]), w))
        placed.append(Assignment(name, w, tuple(free[w][:need]), need))
        free[w] = free[w][need:]
    if not missing:
        return Remap(assignments=tuple(placed))
    largest = max((len(f) for f in free.values()), default=0)
    if policy.on_no_spare == "wait":
        if waited_s < policy.wait_timeout_s:
            return Wait(missing=missing, timeout_s=policy.wait_timeout_s, waited_s=waited_s, largest_free=largest)
        return NoRoom(missing=missing, reason=_reason(
            missing, largest, f"waited {waited_s:.0f} s of wait_timeout_s={policy.wait_timeout_s:g}",
            "raise wait_timeout_s, or declare the slice devices=(min, max) and set on_no_spare='shrink' to restore "
            "onto fewer devices"))
    if policy.on_no_spare == "shrink":
        for name, need in missing.items():  # already largest first
            w = min(workers, key=lambda w: (-len(free[w]), w not in spare, w), default=None)
            counts = allowed.get(name, ()) if allowed is not None else [d for d in range(1, need + 1) if need % d == 0]
            fits = [d for d in counts if d <= (len(free[w]) if w is not None else 0)]
            if not fits:
                least = min(counts, default=need)
                return NoRoom(missing=missing, reason=_reason(
                    missing, len(free[w]) if w is not None else 0,
                    f"on_no_spare='shrink' needs a worker with at least {least} free devices for {name!r}, the "
                    f"fewest it runs on (its device counts: {sorted(counts)})",
                    "lower the slice's minimum (devices=(min, max)), or set on_no_spare='wait' to wait for room"))
            count = max(fits)
            placed.append(Assignment(name, w, tuple(free[w][:count]), need))
            free[w] = free[w][count:]
        return Shrink(assignments=tuple(placed))
    return NoRoom(missing=missing, reason=_reason(
        missing, largest, "on_no_spare='fail'",
        "set on_no_spare='wait' to wait for a worker, or declare the slice devices=(min, max) and set "
        "on_no_spare='shrink' to restore onto fewer devices"))


def _reason(missing: Mapping[str, int], largest: int, why: str, change: str) -> str:
    names = ", ".join(f"{name!r} ({need} devices)" for name, need in missing.items())
    many = len(missing) > 1
    return (f"lost slice{'s' if many else ''} {names} find{'' if many else 's'} no live, uncordoned worker with that "
            f"many free devices (the most free on one is {largest}; {why}). To go on, add a worker with at least "
            f"{max(missing.values())} free devices, or {change} in the job's recovery policy")
