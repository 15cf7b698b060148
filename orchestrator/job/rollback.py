"""Loss spikes, non-finite values and convicted workers rolled back: the executor's :class:`JobRollbacks`
(docs/integrity.md).

It is the one owner of the run's skipped stream positions (:class:`~rallypoint.recovery.skips.Skips`)
and of its rollbacks. :meth:`JobRollbacks.observe` judges each completed step (``JobEvents`` calls
it as steps complete) with the job's :class:`~rallypoint.recovery.spikes.SpikeDetector`: under
``on_spike = "warn"`` a spike is a ``job.spike`` event; under ``"rollback"`` (and a non-finite value
under ``on_nonfinite = "rollback"``, :meth:`JobRollbacks.nonfinite`) it raises :class:`RollBack`, which
the executor's loop catches and hands to :meth:`JobRollbacks.roll_back`. The grants halt at the spike,
and once no recovery or drain is under way the whole job goes back:

1. every runtime is unloaded (a save in flight commits first) and forgotten, the log floor reset;
2. the cut is the newest consistent one at or before ``s - spike_rewind`` (0, the inits, when none
   is kept); the commits past it are dropped (etcd and the copies beside the checkpoints), so no
   resume or adoption can restore a state the spike made;
3. the batches of steps ``[s - spike_rewind, s + spike_skip)`` are skipped: the skips grow, and the job
   record keeps them (with the rollback) before anything loads, so an adoption from here on reads
   the same batches;
4. every slice loads from the cut with the skips; the progress and the detector go back to the cut,
   and the grants start again (``job.rolled_back``).

A spike that would be one rollback more than ``max_rollbacks`` fails the job, naming the spikes'
steps. A resumed or adopted run takes its skips and rollbacks from the job record and seeds the
detector from ``metrics.jsonl``.

It also owns the job's :class:`~rallypoint.orchestrator.job.verify.JobVerifier` (silent data
corruption) and carries out its convictions: the suspect is cordoned ``suspect-sdc``; a convicted
primary halts the grants and, once no recovery or drain is under way, the job goes back the same way
(every runtime unloaded first, so none of the suspect's saves commits later) to the newest cut at or
before its slice's trusted one, every slice but the suspect's loads there, and a recovery moves the
suspect's slices to other workers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.etcd.store import Put
from rallypoint.orchestrator.job.cut import JobCut
from rallypoint.orchestrator.job.loads import JobLoads
from rallypoint.orchestrator.job.metrics import METRICS_FILE, read_metrics
from rallypoint.orchestrator.job.progress import JobProgress, StepDone
from rallypoint.orchestrator.job.state import JobFailed
from rallypoint.orchestrator.job.term import JobTerm
from rallypoint.orchestrator.job.verify import CORDON_BY, Conviction, JobVerifier
from rallypoint.recovery.decide import Budget, Fail
from rallypoint.recovery.nonfinite import NonFinite
from rallypoint.recovery.skips import Skips
from rallypoint.recovery.spikes import Spike, SpikeDetector, SpikeSettings, rollback_plan, too_many

MAX_KEPT_ROLLBACKS = 64  # rollbacks the job record lists (the count is kept whole)


class RollBack(Exception):
    """The job rolls back from ``spike`` (raised by the job's events, caught by the executor's loop)."""

    def __init__(self, spike: Spike) -> None:
        super().__init__(str(spike))
        self.spike = spike


class JobRollbacks:
    """One job's spike policy, its skips and its rollbacks (see the module doc). Single-threaded.

    Args:
        spec: the job.
        term, progress, job_cut, loads: the collaborators a rollback moves (commits, progress, loads).
        port: the job's recovery port (``cut_step``, ``reset_all``, ``lost_at_load``).
        recovery, drains, stopping: what a rollback waits for (a recovery or a drain under way, a stop).
        log, event: the executor's logger and ``event(name, step, **detail)``.
        grant: grants every worker what the job's grants say now; ``window``: the steps in flight now.
        recover: recovers lost workers (``JobLosses.recover``).
        record: writes the job record (raising when it cannot: the skips must be kept before a load).
    """

    def __init__(self, spec: Any, *, term: JobTerm, progress: JobProgress, job_cut: JobCut, loads: JobLoads,
                 port: Any, recovery: Any, drains: Any, stopping: Callable[[], bool], log: Any,
                 event: Callable[..., None],
                 grant: Callable[[], None], recover: Callable[..., None],
                 record: Callable[[], None], window: Callable[[], int], clock: Any, budget: Budget,
                 places: Any, tls: Any) -> None:
        self.spec, self.term, self.progress, self.job_cut, self.loads, self.port = \
            spec, term, progress, job_cut, loads, port
        self.recovery, self.drains, self.stopping = recovery, drains, stopping
        self.log, self.event, self.grant, self.recover, self.record = log, event, grant, recover, record
        self.window, self.clock, self.budget = window, clock, budget
        self.settings = SpikeSettings()
        self.detector = SpikeDetector(self.settings)
        self.skips = Skips()
        self.rollbacks: list[dict[str, Any]] = []  # the newest MAX_KEPT_ROLLBACKS
        self.count = 0  # every rollback of the run
        self.pending: Spike | None = None  # a rollback waiting for a recovery or a drain to end
        self.convicted: Conviction | None = None  # a convicted primary whose job goes back (poll), waiting likewise
        self.places = places
        self._waiting = ""  # why the rollback waiting waits (logged when it changes)
        self._verifications: Any = None  # what a resumed or adopted run's record says of its verifications
        self.verifier = JobVerifier(  # silent data corruption: shadow re-execution (job/verify.py)
            spec, cluster=term.keys.cluster, tls=tls, term=term, placement=lambda: dict(places.slices),
            skips=lambda: self.skips, cluster_now=lambda: read_cluster(term.store, term.keys),
            deterministic=lambda: not places.nondeterministic, event=event, log=log)

    def configure(self, settings: SpikeSettings, on_nonfinite: str, run_dir: Path | None, checkpoint_every: int,
                  log_limit_bytes: int) -> None:
        """The job's settings, once checked. Raises JobFailed: a rollback asked of a job without checkpoints."""
        self.settings = settings
        self.verifier.configure(settings.verify_every, settings.verify_seed, run_dir, checkpoint_every, log_limit_bytes,
                                fraction=settings.verify_fraction)
        self.verifier.adopt(self._verifications)  # a resumed or adopted run's trusted cuts and counts
        self.detector = SpikeDetector(settings)
        if (settings.mode == "rollback" or on_nonfinite == "rollback") and run_dir is None:
            raise JobFailed("on_spike or on_nonfinite 'rollback' needs checkpoints to roll back to: give the job a "
                            "checkpoint directory (--checkpoint-dir), or use 'warn'")

    def adopt(self, record: dict[str, Any]) -> None:
        """A resumed or adopted run of the same run: the skips and rollbacks its record keeps (the loads read the
        skips). Raises JobFailed: the record's skips are malformed."""
        try:
            self.skips = Skips.from_json(record.get("skips"))
        except ValueError as exc:
            raise JobFailed(f"the job record's skipped stream positions are malformed ({exc}): the run cannot go on "
                            "reading the batches it read; start a new run (rallypoint run --new-run)") from None
        kept = record.get("rollbacks")
        self.rollbacks = [r for r in kept if isinstance(r, dict)][-MAX_KEPT_ROLLBACKS:] if isinstance(kept, list) else []
        count = record.get("rollback_count")
        self.count = count if isinstance(count, int) and count >= len(self.rollbacks) else len(self.rollbacks)
        self.loads.skips = self.skips
        self._verifications = record.get("verifications")  # the verifier takes them once configured

    def seed(self, run_dir: Path | None, start: int) -> None:
        """The detector's baseline from the run's ``metrics.jsonl`` (the steps before ``start``)."""
        if self.settings.mode != "off" and run_dir is not None and (run_dir / METRICS_FILE).exists():
            self.detector.seed(read_metrics(run_dir / METRICS_FILE).curve(self.settings.metric), start)

    def to_json(self) -> dict[str, Any]:
        """What the job record keeps (a resume or adoption reads it back: :meth:`adopt`)."""
        return {"skips": self.skips.to_json(), "rollbacks": list(self.rollbacks), "rollback_count": self.count,
                "verifications": self.verifier.to_json()}

    def summary(self) -> dict[str, Any]:
        """What ``job.finished`` reports."""
        return {"rollbacks": self.count, "verifications": self.verifier.to_json()}

    # -- the executor's loop ------------------------------------------------------------------------

    def poll(self) -> None:
        """A verification's result (a conviction: the suspect cordoned); a conviction or a rollback waiting for a
        recovery or a drain to end, carried out once none is under way."""
        conviction = self.verifier.poll()
        if conviction is not None:
            self.convict(conviction)
        if self.convicted is not None and not self.waits():
            c, self.convicted = self.convicted, None
            self._go_back_from(c)
        elif self.pending is not None:
            self.roll_back()

    def cut_moved(self, cut: int) -> None:
        """The job's cut moved: maybe verify a slice's steps up to it (not while anything moves the job)."""
        self.verifier.cut_moved(cut, busy=bool(self.pending is not None or self.convicted is not None or self.waits()))

    def settled(self) -> bool:
        """Whether the job may end at its final cut: no rollback waits, the verifications of the end are done."""
        return self.pending is None and self.convicted is None and self.verifier.settled()

    def convict(self, c: Conviction) -> None:
        """A worker computes wrong numbers: cordon it (``suspect-sdc``); when it held the slice, halt the grants: the
        job goes back (:meth:`_go_back_from`) once no recovery or drain is under way."""
        why = {"by": CORDON_BY, "job": self.spec.job, "slice": c.slice, "step": c.step, "at": self.clock.wall(),
               "evidence": c.evidence}
        self.term.txn([Put(self.term.keys.cordon(c.worker), json.dumps(why))])
        self.log.error("job.suspect_cordoned", worker=c.worker, slice=c.slice, step=c.step, primary=c.primary)
        if c.primary:
            self.progress.grants.halt(self.progress.completed)  # nothing more is granted on the suspect's numbers
            self.convicted = c  # carried out once no recovery or drain moves the job (poll)

    def _go_back_from(self, c: Conviction) -> None:
        """The job goes back to the newest cut at or before the suspect's slice's trusted one: every runtime
        unloaded (its saves committed first, so none of its commits comes later), the commits past the cut dropped,
        every slice but the suspect's loaded there, and a recovery moves the suspect's slices to other workers."""
        t0 = self.clock.monotonic()
        self.port.reset_all()
        commits = self.term.commits()
        cut = self.port.cut_step(commits, c.trusted + 1)
        self.pending = None  # a spike waiting is judged again on the steps run from the cut
        lost = self._reload(cut, commits, without=c.worker)
        self.log.warning("job.sdc_rolled_back", cut=cut, worker=c.worker, took_s=round(self.clock.monotonic() - t0, 3))
        self.recover({c.worker: f"suspect-sdc: computed slice {c.slice!r} wrong by step {c.step} (verification); "
                                f"the job went back to the cut at step {cut}", **lost}, unload=frozenset({c.worker}))

    # -- judging ------------------------------------------------------------------------------------

    def observe(self, done: StepDone) -> None:
        """A step completed. Raises RollBack: a spike under ``rollback``."""
        if self.settings.mode == "off":
            return
        spike = self.detector.observe(done.step, done.metrics)
        if spike is None:
            return
        self.log.warning("job.spike", action=self.settings.mode, **spike.to_json())
        detail = {k: v for k, v in spike.to_json().items() if k != "step"}
        self.event("job.spike", spike.step, action=self.settings.mode, **detail)
        if self.settings.mode == "rollback":
            raise RollBack(spike)

    def nonfinite(self, bad: NonFinite) -> None:
        """A metric value that is not finite under ``on_nonfinite = "rollback"``. Raises RollBack."""
        raise RollBack(Spike(bad.step, bad.metric, float(bad.value), math.nan, math.nan))

    # -- rolling back -------------------------------------------------------------------------------

    def roll_back(self, spike: Spike | None = None) -> None:
        """Roll the job back from ``spike`` (None: the one waiting), now or once no recovery or drain is under way.

        Raises:
            JobFailed: one rollback more than ``max_rollbacks``, or the job cannot load from the cut.
        """
        if spike is not None:
            self.progress.grants.halt(spike.step)  # nothing past the spike is granted meanwhile
            why = too_many(self.count, self.rollbacks, spike, self.settings)
            if why is not None:
                raise JobFailed(why + self._keep_before(spike))
            if self.pending is None or spike.step < self.pending.step:
                self.pending = spike
        if self.pending is None:
            return
        waiting = self.waits()
        if waiting:
            if waiting != self._waiting:  # once per reason, not at every turn of the loop
                self.log.info("job.rollback_waits", step=self.pending.step, reason=waiting)
            self._waiting = waiting
            return
        self._waiting = ""
        spike, self.pending = self.pending, None
        self._go_back(spike)

    def _keep_before(self, spike: Spike) -> str:
        """The job fails at ``spike``: every runtime unloaded (a save under way commits first), the commits past the
        newest cut at or before the spike dropped, so a resume after the fix starts before it. Says which cut."""
        self.port.reset_all()
        commits = self.term.commits()
        cut = self.port.cut_step(commits, spike.step + 1)
        self._drop_past(commits, cut)
        return f"; the cut at step {cut}, before the spike, is kept (no commit past it): `rallypoint resume` starts there"

    def waits(self) -> str:
        """Why a rollback must wait now ("": it may go): a recovery or a drain under way, or a stop."""
        active = self.recovery.active
        return (f"recovery {active.record.number} runs" if active is not None else self.drains.busy()
                or ("the job stops" if self.stopping() else ""))

    def _go_back(self, spike: Spike) -> None:
        t0 = self.clock.monotonic()
        self.port.reset_all()  # every runtime unloaded (a save in flight commits first), the log floor reset
        commits = self.term.commits()  # with what those saves committed
        first = spike.step - self.settings.rewind
        cut = self.port.cut_step(commits, first + 1) if first >= 0 else 0
        plan = rollback_plan(spike.step, self.settings, self.skips, [cut], int(self.spec.steps))
        self.skips = self.loads.skips = plan.skips
        self.count += 1
        entry = {"rollback": self.count, "spike": spike.to_json(), **plan.to_json(), "at": round(self.clock.wall(), 3)}
        self.rollbacks = [*self.rollbacks, entry][-MAX_KEPT_ROLLBACKS:]
        lost = self._reload(plan.cut, commits)
        took = round(self.clock.monotonic() - t0, 3)
        self.log.warning("job.rolled_back", took_s=took, **entry)
        self.event("job.rolled_back", step=spike.step, took_s=took, **entry)
        if lost:
            self.recover(lost)
        else:
            self.grant()

    def _reload(self, cut: int, commits: dict[str, list[Any]], *, without: str = "") -> dict[str, str]:
        """Every runtime was unloaded: drop the commits past ``cut``, record the job (the skips kept before any
        batch is read with them), load every slice from ``cut`` but those on ``without``, and take the progress, the
        detector and the trusted cuts back to it. Returns the workers lost at the load (a recovery moves them).

        Raises:
            JobFailed: the load failed for another reason than a lost worker.
        """
        self._drop_past(commits, cut)
        kept = {s: [c for c in cs if c.step <= cut] for s, cs in commits.items()}
        self.record()
        workers = {p.worker for p in self.places.slices.values()} - {without} if without else None
        lost = self.port.lost_at_load(self.budget, self.loads.load(workers, cut, kept), cut)
        if isinstance(lost, Fail):
            raise JobFailed(f"going back to step {cut}: {lost.reason}")
        self.progress.rewind(cut, {s: [c.step for c in cs] for s, cs in kept.items()})
        self.progress.widen(self.window())
        self.detector.rewind(cut)
        self.verifier.forget_from(cut)
        return lost

    def _drop_past(self, commits: dict[str, list[Any]], cut: int) -> None:
        """The commits past ``cut`` stop counting (etcd and the copies beside the checkpoints)."""
        for slice_name, cs in commits.items():
            for c in cs:
                if c.step > cut:
                    self.job_cut.drop_commit(slice_name, c.step)
