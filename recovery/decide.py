"""What a recovery does when something goes wrong: one pure function over plain data.

A recovery (``rallypoint.orchestrator.job.recovery_machine``) runs its states; when one of
them meets a **setback** (a worker lost again, a checkpoint that does not restore, a
live worker that refuses, an output log that does not reach back, a job making no
progress) it asks :func:`decide`, which answers with one :class:`Decision`:

* :class:`Refence`: these workers are lost too: back to FENCING with them;
* :class:`FallBack`: the cut's checkpoint is corrupt: drop its commit, every slice
  restarts from an older cut;
* :class:`Escalate`: partial replay cannot work: every slice restarts from the same cut;
* :class:`Retry`: ask again after a pause (a live worker refused, e.g. its storage, or a
  call was cancelled);
* :class:`Fail`: give up, with the reason (at once when the job's own program failed:
  no worker is to blame and none is fenced).

Each setback has a **verdict** (:class:`Verdict`) with its own budget per recovery
(:class:`Budget`); past it, the decision is :class:`Fail`, naming the verdict, the count and the limit.
:func:`plan_recovery` makes the other choice a recovery takes, partial or restart-all.
No I/O here: everything is tested exhaustively in ``tests/recovery/test_decide.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from rallypoint.recovery.replay import Graph, ReplayPlan, plan_replay, restart_all_plan


class Verdict(enum.Enum):
    """What a failure toward a worker is, and so where a setback comes from (one budget each).

    :func:`rallypoint.orchestrator.job.failures.classify_rpc_error` gives every failed call
    to a worker one of these; a recovery's setback carries the gravest (:class:`Setback`).
    """

    LOST = "lost"  # the worker process is gone (its socket refuses or was reset)
    SUSPECT = "suspect"  # a worker that did not answer in time, or ambiguously
    CORRUPT = "corrupt"  # a checkpoint of the cut did not restore
    REFUSED = "refused"  # a live worker refused a load or rewire
    LOG_SHORT = "log_short"  # a survivor's output log does not reach back to the cut
    INVALID = "invalid"  # a worker found the request itself wrong
    PROGRAM = "program"  # the job's own program failed on a worker, deterministically
    CANCELLED = "cancelled"  # a call was cancelled (ours, or a server shutting down): never a suspicion
    STALL = "stall"  # the job made no progress for the stall timeout (no call failed)


@dataclass(frozen=True)
class Budget:
    """How many setbacks of each verdict one recovery (or one job, for stalls) absorbs."""

    lost: int = 10
    suspect: int = 10
    corrupt: int = 5
    refused: int = 10
    log_short: int = 2
    invalid: int = 0
    cancelled: int = 10
    stall: int = 3

    def limit(self, verdict: Verdict) -> int:
        """How many setbacks of ``verdict`` are absorbed (none of the program's own: it fails the same anywhere)."""
        return 0 if verdict is Verdict.PROGRAM else int(getattr(self, verdict.value))


@dataclass(frozen=True)
class Setback:
    """What went wrong in one attempt.

    Attributes:
        verdict: its kind.
        workers: the workers it concerns, each with why.
        registered: for each of those, whether the incarnation the job placed there is still
            registered in etcd (a worker whose registration is gone is lost, whatever it said).
        corrupt: for CORRUPT, the (slice, step) of the checkpoint that did not restore.
        cut: the cut the attempt restored from.
    """

    verdict: Verdict
    workers: Mapping[str, str] = field(default_factory=dict)
    registered: Mapping[str, bool] = field(default_factory=dict)
    corrupt: tuple[str, int] | None = None
    cut: int = 0
    detail: str = ""


@dataclass(frozen=True)
class Refence:
    lost: Mapping[str, str]
    reason: str


@dataclass(frozen=True)
class FallBack:
    """Drop the commit ``drop`` (slice, step); restart every slice from a cut below ``before``."""

    before: int
    drop: tuple[str, int] | None
    reason: str


@dataclass(frozen=True)
class Escalate:
    """Restart every slice from the same cut (``restart-all``)."""

    reason: str


@dataclass(frozen=True)
class Retry:
    after_s: float
    reason: str


@dataclass(frozen=True)
class Fail:
    reason: str


Decision = Refence | FallBack | Escalate | Retry | Fail

RETRY_AFTER_S = 1.0


def decide(setback: Setback, count: int, budget: Budget) -> Decision:
    """The decision for ``setback``, the ``count``-th of its verdict (counting it).

    Rules, in order:

    0. PROGRAM: :class:`Fail` at once, naming the part of the program, the worker and the error
       (the same program fails the same on any worker: fencing one would only use up the spares).
    1. Past the verdict's budget: :class:`Fail` naming the verdict, count and limit.
    2. LOST, or SUSPECT (no answer in time: fencing confirms a suspicion safely, a
       worker that was only slow comes back as a new incarnation): :class:`Refence`.
    3. CORRUPT at a cut above 0: :class:`FallBack` below it, dropping that commit.
       At 0 (the inits), nothing older exists: :class:`Fail`.
    4. LOG_SHORT: :class:`Escalate` to restart-all from the same cut.
    5. REFUSED or CANCELLED: those whose registration is gone are lost (:class:`Refence`);
       if all still live, :class:`Retry` after a pause.
    6. INVALID: :class:`Fail` (the request is wrong; no retry can help).
    7. STALL: :class:`Refence` the workers that made no progress.
    """
    limit = budget.limit(setback.verdict)
    what = setback.detail or "; ".join(f"{w}: {why}" for w, why in sorted(setback.workers.items()))
    if setback.verdict is Verdict.PROGRAM:
        return Fail(f"the job's program failed (no worker is to blame; none was fenced): {what}")
    if count > limit:
        return Fail(f"recovery gave up: {setback.verdict.value} setbacks {count} > limit {limit} (last: {what})")
    if setback.verdict in (Verdict.LOST, Verdict.SUSPECT) or (setback.verdict is Verdict.STALL and setback.workers):
        return Refence(dict(setback.workers), f"{setback.verdict.value}: {what}")
    gone = {w: why for w, why in setback.workers.items() if not setback.registered.get(w, True)}
    if setback.verdict in (Verdict.REFUSED, Verdict.CANCELLED) and gone:
        return Refence(gone, f"{setback.verdict.value}, and its incarnation ended: {what}")
    if setback.verdict is Verdict.CORRUPT:
        if setback.cut <= 0:
            return Fail(f"cannot restore: {what} (no older checkpoint than step 0)")
        return FallBack(setback.cut, setback.corrupt,
                        f"the checkpoint at step {setback.cut} did not restore ({what}); every slice restarts "
                        "from an older cut")
    if setback.verdict is Verdict.LOG_SHORT:
        return Escalate(f"a survivor's output log does not reach back to step {setback.cut} ({what}): every "
                        "slice restarts from the cut")
    if setback.verdict is Verdict.REFUSED:
        return Retry(RETRY_AFTER_S, f"refused by live workers, asking again: {what}")
    if setback.verdict is Verdict.CANCELLED:
        return Retry(RETRY_AFTER_S, f"a call to a live worker was cancelled, asking again: {what}")
    if setback.verdict is Verdict.STALL:
        return Fail(f"the job made no progress and no worker can be blamed: {what}")
    return Fail(f"a worker rejected the request: {what}")


DEFAULT_MAX_FAULTS = 10
DEFAULT_MAX_PREEMPTIONS = 30
DEFAULT_FAILURE_WINDOW_S = 3600.0


@dataclass(frozen=True)
class FailurePolicy:
    """The job's own budget, beside each recovery's: at most ``max_faults`` recoveries from faults and
    ``max_preemptions`` from preemptions in any window of ``window_s`` (as Ray Train's ``max_failures``,
    but sliding, and apart for preemptions, which are no fault of the job's)."""

    max_faults: int = DEFAULT_MAX_FAULTS
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    window_s: float = DEFAULT_FAILURE_WINDOW_S


@dataclass(frozen=True)
class Disruption:
    """One recovery the job went through: its number, when it started (a monotonic clock), why."""

    number: int
    at: float
    preempted: bool
    why: str


class FailureWindow:
    """The recoveries of a job within its policy's sliding window (pure: the caller passes the clock's time)."""

    def __init__(self, policy: FailurePolicy) -> None:
        self.policy = policy
        self.recent: list[Disruption] = []

    def admit(self, d: Disruption) -> Fail | None:
        """Count the recovery ``d`` about to start; :class:`Fail`, listing those in the window, if it is one too many."""
        self.recent = [r for r in self.recent if r.at > d.at - self.policy.window_s]
        self.recent.append(d)
        kind = [r for r in self.recent if r.preempted == d.preempted]
        limit = self.policy.max_preemptions if d.preempted else self.policy.max_faults
        if len(kind) <= limit:
            return None
        what, setting = ("preemptions", "max_preemptions") if d.preempted else ("faults", "max_faults")
        listed = "; ".join(f"recovery {r.number} ({d.at - r.at:.0f}s ago): {r.why}" for r in kind)
        return Fail(f"the job failed {len(kind)} times from {what} in the last {self.policy.window_s:g}s, more than "
                    f"its {setting}={limit} (raise {setting} or failure_window_s in the job's failure policy): "
                    f"{listed}")


def plan_recovery(graph: Graph, *, policy: str, lost_slices: set[str], cut: int,
                  done_through: Mapping[str, int], logged_from: Mapping[str, int]) -> tuple[ReplayPlan, str]:
    """The replay plan for ``policy`` and why it became restart-all ("" when it did not).

    Under ``partial`` the replay planner's least set; if that pulls in a node of a
    surviving slice (its producer's output log does not reach back to ``cut``), every
    slice restarts from the cut instead. ``logged_from``: each surviving node's oldest
    step its output log still holds.
    """
    if policy == "partial":
        survivors = {n.name for n in graph.nodes if n.slice not in lost_slices}
        plan = plan_replay(graph, lost_slices=lost_slices, checkpoint_step=cut,
                           log_from={n: logged_from[n] for n in survivors}, done_through=done_through)
        pulled = sorted(n for n in plan.pulled_in if n in survivors)
        if not pulled:
            return plan, ""
        reason = (f"nodes {pulled} of surviving slices would have to re-run from step {cut} (their output logs "
                  "do not reach back that far): every slice restarts from the cut")
        return restart_all_plan(graph, cut, done_through, lost_slices=lost_slices), reason
    return restart_all_plan(graph, cut, done_through, lost_slices=lost_slices), ""
