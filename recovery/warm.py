"""The warm-spare policy: which spares compile which slices' programs before any loss. Pure.

A recovery that moves a lost slice onto a spare pays, on the slice's first instance
there, the compilation of its programs (docs/recovery.md). A **warm** spare has
compiled them already, on the devices the recovery would give the slice, so the
first call finds its executable ready. :func:`plan_warm` decides which spares warm
which slices; the executor carries the plan out (``WarmJob``) and the workers hold
the executables (``workers/warm.py``).

The plan follows the remap policy (:func:`rallypoint.recovery.remap.plan_remap`), so
that the spare a recovery takes is the one that is warm:

* a spare may warm a slice only if it has room for the slice's devices (its free
  device count, the check a remap makes of a spare);
* a slice is warmed first on the spare a remap would choose for it alone (the
  tightest fit, then the name), then, while the budget lasts, on the spares a remap
  would fall back to, in that order (one more spare per slice and round, so every
  slice is warm somewhere before any is warm twice);
* the budget: at most ``max_spares`` spares warm anything, each at most ``per_spare``
  slices (their executables take host memory);
* slices go largest first (then by name), as a remap places them.

Every slice that fits some spare is warm on at least one as long as the budget has
room for it (``tests/recovery/test_warm.py`` checks this against every assignment).
The same input gives the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

DEFAULT_WARM_SPARES = 2  # a job's warm_spares when its spec leaves it unset
DEFAULT_PER_SPARE = 8  # slices one spare warms for one job, at most

WarmPlan = dict[str, list[str]]  # spare worker -> the slices it warms, largest first


def plan_warm(spares: Mapping[str, int], slices: Mapping[str, int], *, max_spares: int,
              per_spare: int = DEFAULT_PER_SPARE) -> WarmPlan:
    """Which spares warm which slices (see the module doc).

    Args:
        spares: each spare worker that may take a lost slice -> its free device count.
        slices: each slice of the job -> the devices it needs.
        max_spares: how many spares warm anything, at most (0: warming is off).
        per_spare: how many slices one spare warms, at most.

    Returns:
        spare -> the slices it warms, largest first then by name; spares that warm
        nothing are left out.

    Raises:
        ValueError: a negative budget, or a count below 1; the message names it.
    """
    if isinstance(max_spares, bool) or not isinstance(max_spares, int) or max_spares < 0:
        raise ValueError(f"warm_spares must be an int >= 0 (0: off), got {max_spares!r}")
    if isinstance(per_spare, bool) or not isinstance(per_spare, int) or per_spare < 1:
        raise ValueError(f"per_spare must be an int >= 1, got {per_spare!r}")
    for what, counts in (("spare", spares), ("slice", slices)):
        for name, n in counts.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < (0 if what == "spare" else 1):
                raise ValueError(f"{what} {name!r} has an invalid device count {n!r}")
    order = sorted(slices, key=lambda s: (-slices[s], s))
    # Each slice's spares in the order a remap of that slice alone would take them.
    prefer = {s: sorted((w for w, free in spares.items() if free >= slices[s]), key=lambda w: (spares[w], w))
              for s in order}
    plan: dict[str, list[str]] = {}
    if max_spares == 0:
        return plan
    while True:
        added = False
        for s in order:
            for w in prefer[s]:
                held = plan.get(w)
                if held is not None and (s in held or len(held) >= per_spare):
                    continue
                if held is None and len(plan) >= max_spares:
                    continue
                plan.setdefault(w, []).append(s)
                added = True
                break
        if not added:
            break
    return {w: sorted(ss, key=lambda s: (-slices[s], s)) for w, ss in sorted(plan.items())}


def warm_devices(free: Sequence[int], need: int) -> tuple[int, ...]:
    """The local devices a remap would lease on a spare with ``free`` devices: the lowest ``need``."""
    return tuple(sorted(free)[:need])
