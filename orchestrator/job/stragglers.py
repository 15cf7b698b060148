"""A job's straggler watch: measures each slice's own time per step, asks the policy, starts the move.

The executor tells :class:`StragglerWatch` of every first run of an instance
(:meth:`StragglerWatch.instance`) and of every pass of its progress loop
(:meth:`StragglerWatch.advanced`, after steps completed and were granted). From those
it measures, per slice and step, the slice's **own time**: the union of its
instances' ``[ready, done]`` intervals, where an instance is ready once its step was
granted and the executor heard every instance it reads (the same microbatch of a
per-microbatch producer, a per-step producer, every microbatch of a gathered one, the
producer of a state it reads at the step before) and, from a checkpoint step on, once
the executor heard every instance of the slice at the steps before it (a slice saves its
states before it runs any instance of that step or later: a source with no inputs,
granted early, waits there for the slice's own last step, which waits for every stage
after it) and saved it (the ``saving_s`` its worker reports: a save is work, and the
slice that saves last holds up every other), less the ``compute_s`` and ``busy_s`` (the
loop's bookkeeping around the call: finding the instance, taking its inputs, routing its
outputs) its instances report: what is left is time the slice had work it could do and did not
(stopped, starved of CPU, blocked), while a slice busy computing (the pipeline's
bottleneck, whose work queues behind its own) has little. An instance with an input
not heard yet counts nothing (its producer, not it, is late). A stage stopped half the
time thus shows its stops as its own time, while the stages waiting for it show none.

Samples count only while the job runs undisturbed (no drain, no recovery, no spare
compiling the job's programs, no pause of the whole job: no instance heard for
``PAUSE_S``, as when etcd is away and the executor and workers wait; and not in the
``window`` steps after one: a freshly loaded runtime compiles on its first calls, a
rewired one sends its logged outputs again, and an instance ready since its grant
would be charged the whole pause). Each slice's **baseline** is the mean of its first
``window`` samples after the first ``WARMUP_STEPS`` steps (compiles), then of its samples
before the window judged, up to ``HISTORY_WINDOWS`` windows of them: a load that drifts
over minutes (other jobs, other processes on the host) moves the baseline with it, while
a slice that turned slow is judged against the steps before it did. A mean, as the window
is judged by its mean: a slice whose own time comes in bursts (the stage with the most
instances, on a busy host) has them in both, where a median left them out of the
baseline only. From then on
every completed step asks :func:`rallypoint.recovery.stragglers.judge`. A
:class:`~rallypoint.recovery.stragglers.Migrate` starts a drain of the slice's worker
(reason ``straggler``) when a spare has room, after cordoning the worker, as an
operator's drain does, and only while another spare with that room is left for
recoveries (``KEEP_SPARES``): no room: ``straggler.no_spare``, asked again a window later;
etcd away: the window starts again (a worker waiting on etcd is not a slow host).
Every decision that names a straggler is a ``straggler.*`` log event and a
``job.straggler`` JobEvent carrying its evidence. When the drain ends (``done``) the worker
stays cordoned on probation (the cordon lapses with its etcd lease after
``straggler_probation_s``), or for good when it was moved off before within
``straggler_repeat_window_s`` (``kept_out``, reported); a cancelled or aborted drain takes
the cordon back.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

from rallypoint.basics.clock import Clock
from rallypoint.etcd.cluster_view import ClusterSnapshot
from rallypoint.orchestrator.job.drain import DrainRecord
from rallypoint.orchestrator.job.straggler_marks import Marks
from rallypoint.orchestrator.job.state import JobState
from rallypoint.recovery.load_plan import SlicePlace
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.remap import Remap, RemapPolicy, eligible, plan_remap
from rallypoint.recovery.slices import stateful_slices
from rallypoint.recovery.stragglers import Keep, Migrate, Probation, StragglerSettings, judge, probation

WARMUP_STEPS = 2  # the first steps of a run compile their programs: never a baseline
KEPT_DECISIONS = 20  # the decisions job.finished reports (the newest)
CORDON_BY = "straggler"  # the cordon's "by": what the chaos harness (an operator) may take back
KEEP_SPARES = 1  # spares with room a straggler move leaves for recoveries: a loss needs a spare more than a slow slice
HISTORY_WINDOWS = 5  # a slice's baseline: the mean of its samples before the window judged, this many windows
PAUSE_S = 0.5  # no instance of the job heard for this long: the job stood still, the steps around it are not judged


class Progress(Protocol):
    """The job's progress, read-only (:class:`~rallypoint.orchestrator.job.progress.JobProgress`)."""

    @property
    def completed(self) -> int: ...
    @property
    def granted(self) -> int: ...
    @property
    def start(self) -> int: ...


class StragglerPort(Protocol):
    """What the watch needs of its job; the executor implements it, tests fake it."""

    progress: Progress

    def busy(self) -> str:
        """Why no slice is judged now ("" when the job runs undisturbed; "every step is granted..." at its end)."""

    def placement(self) -> Mapping[str, SlicePlace]:
        """Slice -> where it runs now."""

    def loaded_workers(self) -> list[str]:
        """The workers whose runtimes the job uses now."""

    def cluster(self) -> ClusterSnapshot | None:
        """The cluster as etcd has it (None: etcd is away)."""

    def cordon(self, worker: str, slice_name: str, probation: Probation) -> str:
        """Cordon ``worker`` as this watch's (``by``: ``CORDON_BY``), lapsing after ``probation.lapse_s`` (None: for
        good); "" when done, else why not."""

    def straggler_moves(self, worker: str) -> list[float]:
        """When ``worker`` was moved off as a straggler before (wall times, any job's; [] when etcd is away)."""

    def note_moves(self, worker: str, moves: tuple[float, ...]) -> None:
        """Record ``worker``'s straggler moves (best effort)."""

    def uncordon(self, worker: str) -> None:
        """Take back the cordon this watch put (best effort)."""

    def drain(self, worker: str) -> DrainRecord:
        """Start a drain of ``worker`` (reason ``straggler``); its record follows it."""

    def event(self, event: str, step: int = 0, **detail: Any) -> None:
        """Send a job event."""


class StragglerWatch:
    """The straggler watch of one job (see the module doc).

    Args:
        spec: the job.
        port: what the watch reads of the job and asks of it.
        clock, log: the injected clock and the executor's logger.
    """

    def __init__(self, spec: pb.JobSpec, port: StragglerPort, *, clock: Clock, log: Any) -> None:
        self.spec, self.port, self.clock, self.log = spec, port, clock, log
        self._settings = StragglerSettings(mode="off")
        self._every_k = 0  # the job's checkpoint interval (0: no checkpoints)
        self.slice_of = {n.name: n.slice for n in spec.nodes}
        self.slices = sorted({s.slice for s in spec.slices})
        per_mb = {n.name: n.per_microbatch for n in spec.nodes}
        every = {n.name: max(n.every, 1) for n in spec.nodes}
        producer = {s.name: s.producer_node for s in spec.states}
        # node -> (producer, how): "mb" the same microbatch, "step" the per-step instance, "all" every microbatch,
        # "prev" the instance at the step before (a state it reads)
        self.deps: dict[str, list[tuple[str, str]]] = {}
        for n in spec.nodes:
            out = []
            for b in n.inputs:
                if b.kind in (pb.InputBinding.REF, pb.InputBinding.GATHER):
                    how = ("all" if b.kind == pb.InputBinding.GATHER or not n.per_microbatch else "mb") \
                        if per_mb[b.node] else "step"
                    out.append((b.node, how))
                elif b.kind == pb.InputBinding.STATE and producer.get(b.state):
                    out.append((producer[b.state], "prev"))
            self.deps[n.name] = out
        self.every, self.per_mb = every, per_mb
        self.stateful = set(stateful_slices(spec))  # slices that save checkpoints (and wait for them)
        self.runs: dict[str, list[tuple[int, int]]] = {s: [] for s in self.slices}  # (every, instances) per node
        for n in spec.nodes:
            self.runs.setdefault(n.slice, []).append((every[n.name], spec.microbatches if n.per_microbatch else 1))
        self.heard_in: dict[tuple[int, str], int] = {}  # (step, slice) -> its instances heard
        self.slice_done: dict[tuple[int, str], float] = {}  # (step, slice) -> when its last instance was heard
        self.save_s: dict[tuple[int, str], float] = {}  # (checkpoint step, slice) -> its blocking save (saving_s)
        self.heard: dict[int, dict[tuple[str, int], float]] = {}  # step -> (node, microbatch) -> when heard
        self.spans: dict[int, dict[str, list[tuple[float, float]]]] = {}  # step -> slice -> [ready, done] intervals
        self.granted_at: dict[int, float] = {}
        self.work: dict[str, list[tuple[float, float]]] = {}  # slice -> when its loop worked, newest last
        self._marks = Marks()  # what lets advanced() drop old marks without a scan of every slice per event
        self.finished_at: dict[int, float] = {}
        self._granted = 0
        self._judged = 0  # steps below this are measured (or skipped)
        self._quiet_from = 0  # the first step measured after a disturbance
        self._warm: dict[str, list[float]] = {s: [] for s in self.slices}
        self.baseline: dict[str, float] = {}
        self.recent: dict[str, deque[float]] = {}
        self._recent_steps: deque[int] = deque()
        self.moved_at: dict[str, int] = {}
        self.pending: dict[str, Any] | None = None  # the straggler drain in flight
        self._next_try = 0  # no spare: ask again from this step
        self._last_said: tuple[str, str, str] | None = None
        self._said_at = -(10 ** 9)
        self.decisions: list[dict[str, Any]] = []
        self._last_instance = float("inf")

    def configure(self, settings: StragglerSettings, checkpoint_every: int) -> None:
        """The job's settings, once checked; ``checkpoint_every`` 0 when the job keeps no checkpoints."""
        self._settings, self._every_k = settings, checkpoint_every

    @property
    def settings(self) -> StragglerSettings:
        return self._settings

    # -- measuring ------------------------------------------------------------------------

    def instance(self, item: pb.InstanceDone) -> None:
        """A first run of an instance was heard now."""
        if self.settings.mode == "off":
            return
        now = self.clock.monotonic()
        if now - self._last_instance > PAUSE_S:
            self._disturbed()  # the job as a whole stood still (etcd away, the executor paused): nobody's own time
        self._last_instance = now
        node, step = item.node, int(item.step)
        mb = int(item.microbatch) if self.per_mb[node] else -1
        slice_name = self.slice_of[node]
        barrier = self._barrier(slice_name, step)
        if item.saving_s > 0 and barrier is not None:  # the slice's loop saved the checkpoint before this instance
            self.save_s[(barrier, slice_name)] = self.save_s.get((barrier, slice_name), 0.0) + float(item.saving_s)
            self._marks.low_save = min(self._marks.low_save, barrier)
        self._marks.low = min(self._marks.low, step)
        if (node, mb) not in self.heard.setdefault(step, {}):
            n = self.heard_in[(step, slice_name)] = self.heard_in.get((step, slice_name), 0) + 1
            if n == self._instances(slice_name, step):
                self.slice_done[(step, slice_name)] = now
        self.heard[step][(node, mb)] = now
        ready = self._ready(node, step, mb)
        if ready is not None and now > ready:
            self.spans.setdefault(step, {}).setdefault(self.slice_of[node], []).append((ready, now))
            self._marks.span(step, ready)
        # The loop ran this instance just before it was heard (the worker's loop runs one instance at a time).
        self.work.setdefault(slice_name, []).append((now - float(item.compute_s) - float(item.busy_s), now))
        self._marks.worked(slice_name, now)

    def _ready(self, node: str, step: int, mb: int) -> float | None:
        """When the instance could start, as the executor heard it; None when an input is not heard yet."""
        ready = self.granted_at.get(step)
        if ready is None:
            return None
        start = self.port.progress.start
        barrier = self._barrier(self.slice_of[node], step)
        if barrier is not None:
            saved = self.slice_done.get((barrier - 1, self.slice_of[node]))
            if saved is None and barrier - 1 >= self._judged:
                return None  # the slice's own earlier steps are not all heard: it waits to save, not by its fault
            if saved is not None:
                ready = max(ready, saved + self.save_s.get((barrier, self.slice_of[node]), 0.0))
        for p, how in self.deps[node]:
            at = step - 1 if how == "prev" else step
            if how == "prev" and at >= 0:
                at -= at % self.every[p]  # the producer's newest run before this step
            if at < start or at % self.every[p]:
                continue  # before this run started, or the producer does not run at that step
            mbs = [mb] if how == "mb" else range(self.spec.microbatches) if self.per_mb[p] else [-1]
            for m in mbs:
                t = self.heard.get(at, {}).get((p, m))
                if t is None:
                    return None
                ready = max(ready, t)
        return ready

    def _instances(self, slice_name: str, step: int) -> int:
        """How many instances the slice runs at ``step``."""
        return sum(k for every, k in self.runs[slice_name] if step % every == 0)

    def _checkpoint_every(self) -> int:
        return self._every_k

    def _barrier(self, slice_name: str, step: int) -> int | None:
        """The checkpoint step a slice's instance at ``step`` waited behind (None: none since the run started)."""
        every = self._checkpoint_every()
        if every <= 0 or slice_name not in self.stateful:
            return None
        at = step - step % every
        return at if at > self.port.progress.start else None

    def advanced(self) -> None:
        """After the executor's progress: note grants, measure completed steps, judge, follow a drain."""
        if self.settings.mode == "off":
            return
        progress, now = self.port.progress, self.clock.monotonic()
        for s in range(max(self._granted, progress.completed), progress.granted):
            self.granted_at.setdefault(s, now)
        self._granted = max(self._granted, progress.granted)
        if self.pending is not None:
            self._follow()
        busy = self.port.busy()
        if busy and not busy.startswith("every step"):
            self._disturbed()
        while self._judged < progress.completed:
            s = self._judged
            self._judged += 1
            self.finished_at[s] = now
            self._measure(s)
        self._marks.drop_old((self.slice_done, self.heard_in), self._judged - 2,  # no scan when none is that old
                             self.save_s, self._judged - 2 - self._checkpoint_every())
        self._marks.drop_work(self.work, self._marks.oldest(now))  # work that ended before every span overlaps none
        for marks, keep_from in ((self.heard, self._judged - 2), (self.spans, self._judged - 2),
                                 (self._marks.span_low, self._judged - 2), (self.granted_at, self._judged - 2),
                                 (self.finished_at, self._judged - 2 * self.settings.window - 2)):
            for old in [s for s in marks if s < keep_from]:
                del marks[old]

    def _disturbed(self) -> None:
        # A runtime loaded (or rewired, resending its log) by a drain or recovery is slower for some steps
        # (first calls compile, logged outputs go out again): a window of steps passes before samples count.
        self._quiet_from = max(self._quiet_from, self.port.progress.completed + self.settings.window)
        if self._recent_steps:  # the samples of every slice join the window together: empty with it
            for q in self.recent.values():
                q.clear()
        self._recent_steps.clear()

    def _own(self, step: int, slice_name: str) -> float:
        """The slice's ready-but-not-done time in the step, less the time its loop was working (on an instance of
        any step: a source granted ahead waits while the loop works on the step before): a slice busy with its own
        work (the pipeline's bottleneck) has little left; one stopped or starved has all of it."""
        ready = _merged(self.spans.get(step, {}).get(slice_name, []))
        return max(0.0, sum(b - a for a, b in ready) - _overlap(ready, _merged(self.work.get(slice_name, []))))

    def _measure(self, step: int) -> None:
        if step < max(self._quiet_from, self.port.progress.start + WARMUP_STEPS):
            return
        own = {s: self._own(step, s) for s in self.slices}
        w = self.settings.window
        if not self.baseline:
            for s, x in own.items():
                self._warm[s].append(x)
            if len(self._warm[self.slices[0]]) >= w:
                self.baseline = {s: statistics.fmean(xs) for s, xs in self._warm.items()}
                self.recent = {s: deque(maxlen=w) for s in self.slices}
                self.log.info("straggler.baseline", step=step, window=w,
                                 baseline_s={s: round(v, 6) for s, v in self.baseline.items()})
            return
        for s, x in own.items():
            q = self.recent[s]
            if len(q) == q.maxlen:  # the oldest sample leaves the window judged: it joins the slice's history
                self._warm[s] = (self._warm[s] + [q[0]])[-HISTORY_WINDOWS * w:]
                self.baseline[s] = statistics.fmean(self._warm[s])
            q.append(x)
        self._recent_steps.append(step)
        while len(self._recent_steps) > w:
            self._recent_steps.popleft()
        if len(self._recent_steps) >= w:
            self._judge(step)

    # -- deciding ---------------------------------------------------------------------------

    def _judge(self, step: int) -> None:
        placement = self.port.placement()
        workers = {s: p.worker for s, p in placement.items()}
        busy = self.port.busy()
        if not busy and step < self._next_try:
            return  # no spare was found a moment ago (said then): asked again a window later
        got = judge({s: list(q) for s, q in self.recent.items()}, self.baseline, workers, settings=self.settings,
                    step=step, busy=busy, moved_at=self.moved_at)
        if isinstance(got, Keep):
            if got.straggling:
                self._say("keep", got.straggling[0], workers.get(got.straggling[0], ""), got.reason, got.evidence)
            return
        on_worker = sorted(s for s, p in placement.items() if p.worker == got.worker)
        why, cordoned = self._no_room(got.worker, on_worker)
        if why is None:  # etcd is away: workers waiting on it are slow for that, not for their hosts
            self.log.info("straggler.etcd_away", slice=got.slice, worker=got.worker, step=step)
            self._disturbed()
            return
        if why:
            self._next_try = step + self.settings.window
            self._say("no_spare", got.slice, got.worker, why, got.evidence)
            return
        self._migrate(got, on_worker, step, cordoned)

    def _no_room(self, worker: str, slices: list[str]) -> tuple[str | None, bool]:
        """Why no spare has room for ``slices`` ("" when one has; None: etcd is away), and whether ``worker`` is
        cordoned already."""
        snap = self.port.cluster()
        if snap is None:
            return None, False
        placement = self.port.placement()
        exclude = frozenset(self.port.loaded_workers()) | {worker}
        for s in [s for s in slices if placement[s].members]:  # a gang moves whole, onto workers of none of its own
            members = placement[s].members
            each, gang = placement[s].count // len(members), {m.worker for m in members}
            room = sorted(w for w, ws in snap.workers.items()
                          if eligible(w, ws, snap, exclude | gang) and len(ws.free) >= each)
            if len(room) < len(members) + KEEP_SPARES:
                return (f"only {len(room)} workers ({', '.join(room)}) have room for a member of slice {s} "
                        f"({len(members)} members of {each} devices); {KEEP_SPARES} more is kept for recoveries "
                        "(a lost worker needs it more than a slow one)"), False
        need = {s: placement[s].count for s in slices if not placement[s].members}
        if not need:
            return "", worker in snap.cordoned
        plan = plan_remap(snap, need, RemapPolicy(on_no_spare="fail"), exclude=exclude)
        if isinstance(plan, Remap):
            largest = max(need.values())
            room = sorted(w for w, ws in snap.workers.items()
                          if eligible(w, ws, snap, exclude) and len(ws.free) >= largest)
            if len(room) < 1 + KEEP_SPARES:
                return (f"only {len(room)} worker ({', '.join(room)}) has room for {largest} devices; "
                        f"{KEEP_SPARES} such spare is kept for recoveries (a lost worker needs it more than a "
                        "slow one)"), False
            return "", worker in snap.cordoned
        return getattr(plan, "reason", f"no spare ({type(plan).__name__})").replace("lost slice", "slice"), False

    def _migrate(self, got: Migrate, slices: list[str], step: int, cordoned: bool) -> None:
        cordoned_now = False
        on_probation = probation(self.port.straggler_moves(got.worker), self.clock.wall(), self.settings)
        if not cordoned:
            error = self.port.cordon(got.worker, got.slice, on_probation)
            if error:
                self._say("keep", got.slice, got.worker, f"could not cordon worker {got.worker}: {error}", got.evidence)
                return
            cordoned_now = True
        since = got.evidence.get("slow_since_index", 0)
        first_slow = self._recent_steps[since] if since < len(self._recent_steps) else step
        onset = self.finished_at.get(first_slow - 1, self.finished_at.get(first_slow, self.clock.monotonic()))
        detection_s = round(self.clock.monotonic() - onset, 4)
        rec = self.port.drain(got.worker)
        self.pending = {"drain": rec, "slices": slices, "slice": got.slice, "worker": got.worker,
                        "cordoned": cordoned_now, "decided": self.clock.monotonic(), "onset": onset, "step": step,
                        "probation": on_probation}
        self._say("migrate", got.slice, got.worker, f"moving slices {slices} off worker {got.worker} by drain "
                  f"{rec.number}", got.evidence, detection_s=detection_s, slices=slices, drain=rec.number,
                  first_slow_step=first_slow)

    def _follow(self) -> None:
        """The straggler drain in flight: when it ends, note the move (cooldown) or take the cordon back."""
        p = self.pending
        assert p is not None
        rec = p["drain"]
        if rec.state not in ("done", "cancelled", "aborted"):
            return
        self.pending = None
        now = self.clock.monotonic()
        if rec.state == "done":
            for s in rec.moved:
                self.moved_at[s] = rec.step
            kept: Probation = p["probation"]
            self.port.note_moves(p["worker"], kept.moves)
            cordon = (f"worker {p['worker']} is cordoned, {kept.reason}" if p["cordoned"]
                      else f"worker {p['worker']} stays cordoned as it was")
            self._say("migrated", p["slice"], p["worker"], f"slices {sorted(rec.moved)} moved to "
                      f"{sorted(set(rec.moved.values()))} at step {rec.step}; {cordon}",
                      {"drain": rec.to_json()}, moved=rec.moved, migrated_s=round(now - p["decided"], 4),
                      since_onset_s=round(now - p["onset"], 4), drain=rec.number, probation_s=kept.lapse_s)
            if kept.lapse_s is None and p["cordoned"]:
                self._say("kept_out", p["slice"], p["worker"], kept.reason, {"moves": list(kept.moves)})
            return
        if p["cordoned"]:
            self.port.uncordon(p["worker"])
        self._say("not_moved", p["slice"], p["worker"], f"drain {rec.number} {rec.state}: {rec.detail}; the cordon "
                  "this watch put is taken back", {"drain": rec.to_json()}, drain=rec.number)

    def _say(self, decision: str, slice_name: str, worker: str, reason: str, evidence: Any, **extra: Any) -> None:
        """Log and report a decision (a repeated ``keep`` only once per window of steps)."""
        key = (decision, slice_name, reason.split(";")[0])
        if decision == "keep" and key == self._last_said and self._judged - self._said_at < self.settings.window:
            return
        self._last_said, self._said_at = key, self._judged
        detail = {"decision": decision, "slice": slice_name, "worker": worker, "reason": reason,
                  "at": self.clock.wall(), **extra, "evidence": evidence}
        level = self.log.warning if decision in ("migrate", "no_spare", "not_moved", "kept_out") else self.log.info
        level(f"straggler.{decision}", **{k: v for k, v in detail.items() if k != "at"})
        self.port.event("job.straggler", step=self.port.progress.completed, **detail)
        self.decisions = (self.decisions + [{k: v for k, v in detail.items() if k != "evidence"}])[-KEPT_DECISIONS:]


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as disjoint intervals in order."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """How long two lists of disjoint, ordered intervals overlap."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        total += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def busy_reason(state: JobState, *, drain: str, recovery: int | None, warming: bool, all_granted: bool) -> str:
    """Why a job is not running undisturbed ("" when it is): its state, a drain that runs (``drain``: why), the
    number of the recovery that runs, spares warming, every step granted. No slice is judged meanwhile."""
    if state is not JobState.RUNNING:
        return f"the job is {state.value}"
    if drain:
        return drain
    if recovery is not None:
        return f"recovery {recovery} runs"
    if warming:
        # Compiling takes CPU and memory bandwidth; where spares share hosts with the job's workers (the local
        # cluster) the job's slices slow unevenly while it lasts: no slice is judged on those steps.
        return "spares are compiling the job's programs"
    if all_granted:
        return "every step is granted: the job ends soon"
    return ""
