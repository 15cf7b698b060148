"""A lost or deposed leader's jobs, adopted by the next; this leader's jobs handed off when it steps down.

The job service (:mod:`~rallypoint.orchestrator.service.jobs`) hands its leadership events here:

* **on lead(term)** (:meth:`JobAdoption.adopt_all`, in a thread) every job a lost or deposed leader
  ran is adopted: the job records (``keys.jobs``) are read, and each one whose state is not final
  (``succeeded`` / ``failed``) and that this coordinator does not run now is started again from its
  ``<run_dir>/jobspec.pb`` with ``adopted=True`` (the executor releases the old term's device leases,
  unloads its runtimes and loads every slice from the newest consistent cut). A job record without a
  ``run_dir`` (a job without checkpoints) cannot be adopted: that is logged
  (``job.adoption_impossible``) and nothing is written.
* **on step_down(reason)** (:meth:`JobAdoption.step_down`) every executor is stopped (``stop``: each
  ends with ``job.handed_off``, which tells its clients to follow the job to the new leader) when the
  term cannot come back: the coordinator stops, or its leader lease is gone. When only the lease's
  local deadline passed (etcd briefly away) the lease is kept and the term may come back: the
  executors pause on their own and go on under the same term, or are handed off once the term is over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rallypoint.basics.errors import RallypointError, StoreError
from rallypoint.basics.retry import retrying
from rallypoint.etcd.cluster_view import parse_job_records
from rallypoint.orchestrator.job.runs import JOBSPEC_FILE, adoptable_run_dir, check_spec_names, read_spec
from rallypoint.orchestrator.job.runs import request_checkpoint_dir
from rallypoint.orchestrator.job.state import FINAL_RECORD_STATES
from rallypoint.orchestrator.service.registry import JobRun, RunRegistry
from rallypoint.proto import rallypoint_pb2 as pb

HANDOFF_WAIT_S = 5.0  # on a final step-down: how long to wait for the executors to hand off
OLD_TERM_WAIT_S = 60.0  # on lead: how long to wait for an executor of an older term here to end before adopting
AWAIT_TERM_POLL_S = 0.1  # after a step-down that kept the lease: how often to look whether the term is over


class JobAdoption:
    """Adoption and hand-off for one coordinator's job service (see the module doc).

    Args:
        coordinator: its store, keys, clock, election and ``stopping``.
        runs: the service's runs.
        start: starts ``spec`` adopted (``start(spec, checkpoint_root=...)``: its run's checkpoint root);
            None if the job runs here already.
        root: the coordinator's checkpoint directory.
        log: the service's logger.
    """

    def __init__(self, coordinator: Any, runs: RunRegistry, *,
                 start: Callable[..., JobRun | None], root: Callable[[], str], log: Any) -> None:
        self.c, self.runs, self.start, self.root, self.log = coordinator, runs, start, root, log

    def term_holds(self, term: int) -> bool:
        return self.c.election.term == term and not self.c.stopping

    def adopt_all(self, term: int) -> None:
        try:
            kvs, _ = retrying(clock=self.c.clock, what="reading the job records", log=self.log, retry_on=StoreError,
                              should_stop=lambda: not self.term_holds(term), initial_s=0.25, max_s=1.0)(
                lambda: self.c.store.get_prefix(self.c.keys.jobs))
        except StoreError as exc:
            self.log.warning("job.adoption_scan_failed", term=term, error=str(exc))
            return
        parsed, bad = parse_job_records(kvs, self.c.keys)
        for name in bad:
            self.log.warning("job.adoption_impossible", job=name, reason="the job record is not JSON")
        for job, record in parsed.items():
            if not self.term_holds(term):
                return
            state = record.get("state", "")
            if state in FINAL_RECORD_STATES:
                continue
            try:
                self._adopt(job, record, term)
            except Exception as exc:  # one job must not keep the others from being adopted
                self.log.exception("job.adoption_failed", job=job, error=repr(exc))

    def _adopt(self, job: str, record: dict[str, Any], term: int) -> None:
        run = self.runs.get(job)
        if run is not None and run.term == term:
            return  # this coordinator runs it under this term (it paused and kept its term)
        if run is not None:  # an executor of an older term of ours: it hands off, then the job is adopted
            run.executor.stop(f"this coordinator leads a newer term ({term})")
            if not run.done.wait(OLD_TERM_WAIT_S):
                self.log.error("job.adoption_failed", job=job, term=term,
                               reason=f"the executor of term {run.term} did not end within {OLD_TERM_WAIT_S:.0f}s")
                return
        old_term, state = record.get("term"), record.get("state", "")
        rd = record.get("run_dir") or ""
        if not rd:
            self.log.error("job.adoption_impossible", job=job, state=state, old_term=old_term,
                           reason="the job ran without checkpoints (no run_dir in its record): nothing to "
                                  "restart it from; submit it again")
            return
        try:  # the record's run_dir came from etcd: checked before it is read
            checked = adoptable_run_dir(rd, job, self.root())
            spec = pb.JobSpec.FromString(read_spec(checked, record))  # bound to the record's spec_sha256
            if spec.job != job:
                raise ValueError(f"it is the spec of job {spec.job!r}")
            check_spec_names(spec)
            if spec.checkpoint_dir:
                request_checkpoint_dir(spec.checkpoint_dir, self.root())
        except (OSError, ValueError, RallypointError) as exc:
            self.log.error("job.adoption_impossible", job=job, state=state, old_term=old_term,
                           reason=f"cannot use its job spec {Path(rd) / JOBSPEC_FILE}: {exc}")
            return
        if not self.term_holds(term):
            return
        # The run's checkpoint root: run_dir is <root>/<job>/<run>.
        started = self.start(spec, checkpoint_root=str(checked.parent.parent))
        if started is None:
            return  # a ResumeJob started it meanwhile
        if started.first is not None:
            started.events.unsubscribe(started.first)  # nobody asked for it: clients come through WatchJob
        self.log.info("job.adopting", job=job, old_term=old_term, state=state, step_done=record.get("step_done"),
                      cut=record.get("cut"), run_dir=rd, term=term)

    def step_down(self, reason: str) -> None:
        """This coordinator stopped leading: hand its jobs off, unless its term may come back."""
        keeper = self.c.election.keeper
        may_return = not self.c.stopping and keeper is not None and not keeper.fence.dead
        runs = self.runs.all()
        if not runs:
            return
        if may_return:
            # Only the local deadline passed (etcd away): the lease is kept, and the same term
            # resumes if etcd answers in time. The executors pause (they cannot write); a thread
            # hands them off once that term is over for good.
            self.log.warning("job.paused_with_the_term", reason=reason, jobs=sorted(r.job for r in runs))
            threading.Thread(target=self._await_term, args=(runs, keeper, reason), name="await-term",
                             daemon=True).start()
            return
        self._hand_off(runs, reason, wait_s=HANDOFF_WAIT_S)

    def _hand_off(self, runs: list[JobRun], reason: str, *, wait_s: float) -> None:
        for r in runs:
            r.executor.stop(reason)
        deadline = self.c.clock.monotonic() + wait_s
        for r in runs:
            r.done.wait(max(0.0, deadline - self.c.clock.monotonic()))
        self.log.info("job.handed_off_all", reason=reason, jobs=sorted(r.job for r in runs),
                      still_running=sorted(r.job for r in runs if not r.done.is_set()))

    def _await_term(self, runs: list[JobRun], keeper: Any, reason: str) -> None:
        """After a step-down that kept the lease: wait until the term comes back (the same lease
        leads again) or is over for good (the lease is gone or replaced, another term leads here,
        the coordinator stops); then hand off the runs of that term."""
        terms = {r.term for r in runs}
        while True:
            election = self.c.election
            if election.keeper is keeper and election.term in terms:
                return  # the same term leads again: the executors go on where they paused
            if self.c.stopping or election.keeper is not keeper or keeper.fence.dead or (
                    election.term is not None and election.term not in terms):
                break
            if all(r.done.is_set() for r in runs):
                return
            time.sleep(AWAIT_TERM_POLL_S)
        self._hand_off([r for r in runs if not r.done.is_set()], f"{reason}; the term is over", wait_s=0.0)
