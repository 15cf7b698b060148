"""A job's step grants: the one owner of what each worker may run.

:class:`Grants` alone moves every fact that decides a worker's grant:

* ``granted``: workers may run instances of steps below it (the window in flight). It
  widens to ``completed + window`` as steps complete (:meth:`Grants.widen`), never past
  the job's last step, once no more than half the window is left ahead of the completed
  steps: a worker still has that half to run while the grant travels (it never idles for
  a round trip), and a wide window is granted once every half window, not every step;
* ``halted``: the step a metric was not finite at (``on_nonfinite = "stop"``): from then
  on no grant widens (and the progress counts no commit past it);
* ``holds``: worker -> the step it is held at (a drain moving its slices, or a suspend or
  cancel at a step boundary): it is granted nothing at or past that step and saves there;
* ``refused``: the workers whose grant was refused, not lost: granted again at the next
  periodic check (one that does not answer is lost once its registration is gone).

The other parts of the job decide and ask: a drain or a stop wants a :class:`Hold`, the
non-finite guard returns the step to halt at, a refused grant is reported; the executor
carries these out here. :meth:`Grants.now` is the one answer to "what does each worker
get now": the workers' RPCs (:meth:`JobWorkers.grant
<rallypoint.orchestrator.job.workers.JobWorkers.grant>`) send it as it is.

It does no I/O. :class:`~rallypoint.orchestrator.job.progress.JobProgress` holds it (its
``granted`` and ``halted`` read it) and the executor's loop calls it, single-threaded.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class StepGrant:
    """What one worker is sent: steps below ``until`` and the job's ``cut``; ``save_at``: the step it is held and
    saves at (0: none)."""

    worker: str
    until: int
    cut: int
    save_at: int = 0


@dataclass(frozen=True)
class Hold:
    """A decision for the grants' owner: hold ``workers`` at ``step`` (grant nothing at or past it, save there);
    ``step`` None lifts their holds."""

    workers: tuple[str, ...]
    step: int | None


class Grants:
    """The grants of one job of ``steps`` steps (see the module doc)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._granted = 0
        self._halted: int | None = None
        self._holds: dict[str, int] = {}
        self._refused: set[str] = set()

    # -- the read-only view ------------------------------------------------------------------

    @property
    def granted(self) -> int:
        return self._granted

    @property
    def halted(self) -> int | None:
        return self._halted

    @property
    def holds(self) -> Mapping[str, int]:
        return MappingProxyType(self._holds)

    @property
    def all_granted(self) -> bool:
        return self._granted >= self.steps

    def until(self, worker: str) -> int:
        """The step ``worker`` may run up to now: the grant, or its hold where that is lower."""
        return min(self._granted, self._holds.get(worker, self._granted))

    def now(self, workers: Iterable[str], cut: int) -> list[StepGrant]:
        """What to grant each of ``workers`` now (the window, their holds and the ``cut``): the one answer to it."""
        out = []
        for w in workers:
            hold = self._holds.get(w)
            out.append(StepGrant(w, self._granted if hold is None else min(self._granted, hold), cut, hold or 0))
        return out

    # -- moving them ----------------------------------------------------------------------------

    def begin(self, start: int) -> None:
        """The runtimes start from ``start``: nothing past it is granted yet (a halt before a rollback is over)."""
        self._granted = start
        self._halted = None
        self._refused.clear()

    def widen(self, completed: int, window: int) -> bool:
        """Move the grant to ``completed + window`` once at most half the window is left granted ahead of
        ``completed`` (see the module doc). True: workers are to be granted."""
        window = max(1, window)
        if self._halted is not None or self._granted >= self.steps:
            return False
        if self._granted - completed <= window // 2 and completed + window > self._granted:
            self._granted = min(completed + window, self.steps)
            return True
        return False

    def halt(self, step: int) -> None:
        """A metric of ``step`` is not finite and the job stops there: no grant widens from now on."""
        self._halted = step if self._halted is None else min(self._halted, step)

    def hold(self, hold: Hold | None, among: Container[str]) -> list[str]:
        """Hold (or, ``hold.step`` None, release) the workers of ``hold`` (None: no hold). Returns those of them in
        ``among`` (the workers the job runs on): to grant now."""
        if hold is None:
            return []
        for w in hold.workers:
            if hold.step is None:
                self._holds.pop(w, None)
            else:
                self._holds[w] = hold.step
        return [w for w in hold.workers if w in among]

    def refused(self, worker: str) -> None:
        """``worker`` refused its grant (it is not lost): it is granted again at the next :meth:`retry`."""
        self._refused.add(worker)

    def retry(self, workers: Iterable[str]) -> list[str]:
        """The refused workers of ``workers`` (those the job still runs on), to grant again; forgets every refusal."""
        retry, self._refused = sorted(self._refused & set(workers)), set()
        return retry
