"""The recovery controller: carries out, for one job's executor, what the planners decide.

One call of :meth:`RecoveryController.recover` handles the loss of one or more
workers (those lost with the first within ``LOSS_GRACE_S`` join it) and returns
once every lost slice runs again, or raises :class:`rallypoint.orchestrator.executor.JobFailed`
with the reason. Each attempt:

1. **fence** every lost worker (revoke its lease: its registration and device
   leases go in one etcd operation; a partitioned worker can then do no harm);
2. read the commits and take the newest consistent cut ``c`` (below a cut a restore
   found corrupt);
3. **plan**: under ``partial`` the replay planner's least set of nodes to re-run
   (lost slices, plus producers whose output log does not reach back to ``c``; if
   that pulls in a node of a surviving slice, this recovery becomes ``restart-all``
   and says why); under ``restart-all`` every node from ``c``;
4. **remap** the lost slices onto spare devices (the job's ``on_no_spare``: wait for
   one, or fail naming the slice and the setting);
5. **restore**: load the moved slices (``restart-all``: every slice) from their
   checkpoints at ``c``; rewire every surviving worker, whose output log sends the
   replaying nodes their inputs again.

A worker lost during any of this joins the lost set and the attempt starts over;
a corrupt checkpoint moves the cut back one.
"""

from __future__ import annotations

import os
import queue
import re
import time
from typing import TYPE_CHECKING

import grpc

from rallypoint.etcd.commits import commit_record_path
from rallypoint.orchestrator.executor import LOSS_GRACE_S, MAX_RECOVERY_ATTEMPTS, JobFailed, JobState
from rallypoint.orchestrator.job_recovery import RecoveryRecord
from rallypoint.orchestrator.job_workers import WorkerCallFailed
from rallypoint.etcd.store import Delete
from rallypoint.recovery.replay import ReplayPlan, plan_replay, restart_all_plan

if TYPE_CHECKING:
    from rallypoint.orchestrator.executor import JobExecutor

LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
BREAK_REPLAY_ENV = "RALLYPOINT_TEST_BREAK_REPLAY"
"""Test-only switch (the coordinator's environment): a moved slice restores its checkpoint
but starts where it had got, skipping the replay. The chaos suite proves its invariants
catch this; nothing else sets it."""


class RecoveryController:
    def __init__(self, executor: JobExecutor) -> None:
        self.x = executor
        self.log = executor.log

    def _gather(self, lost: dict[str, str]) -> None:
        """Other workers lost at the same moment: their streams break within the grace period."""
        x = self.x
        deadline = time.monotonic() + LOSS_GRACE_S
        kept = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                kind, (worker, gen, item) = x.workers.events.get(timeout=left)
            except queue.Empty:
                break
            if kind == "ended" and x.workers.current(worker, gen):
                lost.setdefault(worker, f"event stream ended: {item}")
            else:
                kept.append((kind, (worker, gen, item)))
        for ev in kept:  # back in order, ahead of anything newer
            x.workers.events.put(ev)

    def recover(self, lost: dict[str, str]) -> None:
        x = self.x
        now = time.monotonic()
        self._gather(lost)
        rec = RecoveryRecord(
            number=len(x.recoveries) + 1, lost={}, reasons=dict(lost), detected_at=time.time(), detected_mono=now,
            detection_s=max(now - x._last_heard.get(w, now) for w in lost),
        )
        for r in x.recoveries:  # a loss during an unfinished recovery: its phases end here
            for p in ("replay", "catch_up"):
                if p not in r.marks:
                    r.mark(p)
        x.recoveries.append(rec)
        frontier = {n.name: x.done_through(n.name) for n in x.graph.nodes}
        old_state = x.state
        x.state = JobState.RECOVERING
        self.log.info("job.state", previous=old_state.value, state=x.state.value, recovery=rec.number, lost=sorted(lost))
        x._record_quietly()
        x._event("job.recovering", step=x.completed, recovery=rec.number, lost=lost)
        lost_workers = dict(lost)
        lost_slices: set[str] = set()  # every slice this recovery moves
        unplaced: set[str] = set()  # of those, the ones without devices now
        bad_cut: int | None = None
        policy = x.settings.policy if x.settings else "partial"
        while True:
            rec.attempts += 1
            if rec.attempts > MAX_RECOVERY_ATTEMPTS:
                raise JobFailed(f"recovery {rec.number} failed {MAX_RECOVERY_ATTEMPTS} times in a row; last losses: "
                                f"{lost_workers}")
            # 1. fence
            for w in list(lost_workers):
                slices = sorted(s for s, p in x.placement.items() if p.worker == w)
                if slices:
                    inc = x.placement[slices[0]].incarnation
                    rec.lost.setdefault(w, slices)
                    x.until_etcd(f"fencing worker {w}", lambda: x.fence(w, inc))
                    if not any(f["worker"] == w and f["incarnation"] == inc for f in x.failures):
                        x.failures.append({"worker": w, "incarnation": inc, "slices": slices, "at": time.time(),
                                           "step": x.completed, "reason": lost_workers[w]})
                    lost_slices.update(slices)
                    unplaced.update(slices)
                x.workers.drop(w)
            rec.mark("fencing")
            # 2. the cut
            commits = x.until_etcd("reading checkpoint commits", x.commits)
            c = x.cut_step(commits, bad_cut)
            # 3. plan
            done_through = {n.name: max(x.done_through(n.name), c) for n in x.graph.nodes}
            plan = self._plan(policy, lost_slices, c, done_through, rec)
            # 4. remap
            need = {s: x._devices(s) for s in sorted(unplaced)}
            exclude = frozenset(set(x.workers.workers) | set(lost_workers))  # fenced ones are gone from etcd
            placed = x.until_etcd("leasing spare devices", lambda: x.remap(need, exclude, rec))
            x.placement.update(placed)
            unplaced -= set(placed)
            rec.moved.update({s: p.worker for s, p in placed.items()})
            rec.mark("remap")
            new_workers = {x.placement[s].worker for s in lost_slices} - set(x.workers.workers)
            # 5. restore and rewire
            try:
                if plan.policy == "partial":
                    self._partial(plan, new_workers, commits)
                else:
                    for w in x.workers.workers:
                        x.workers.unload(w)
                        x.workers.drop(w)
                    self._check(x.load(None, c, commits))
            except _Corrupt as exc:
                self.log.warning("recovery.corrupt_checkpoint", step=c, error=str(exc))
                self._drop_commit(str(exc))
                if c == 0:
                    raise JobFailed(f"recovery {rec.number}: cannot restore: {exc}") from None
                bad_cut, policy = c, "restart-all"
                rec.escalated = f"the checkpoint at step {c} did not restore ({exc}); every slice restarts from an older cut"
                lost_workers = {}
                continue
            except _Lost as exc:
                lost_workers = exc.lost
                self.log.warning("recovery.lost_again", recovery=rec.number, lost=exc.lost)
                continue
            except _Refused as exc:
                # An ended incarnation refuses too: that worker is lost. One that lives but could not
                # load (its storage refused, say) is asked again.
                lost_workers = {w: why for w, why in exc.failed.items() if not self._registered(w)}
                self.log.warning("recovery.load_refused", recovery=rec.number, error=str(exc),
                                 lost=sorted(lost_workers))
                if not lost_workers:
                    time.sleep(1.0)
                continue
            break
        rec.mark("restore")
        rec.policy, rec.checkpoint_step = plan.policy, c
        rec.replay_nodes = sorted(plan.nodes)
        rec.planned_instances = {n: k for n, k in plan.instances(x.spec.microbatches).items() if k}
        rec.targets = {n: r.to_step for n, r in plan.nodes.items()}
        rec.expected.update(rec.planned_instances)
        rec.generations = dict(x.workers.generation)
        rec.frontier = frontier
        if not rec.expected:
            rec.mark("replay")
        x.state = JobState.RUNNING
        self.log.info("job.state", previous=JobState.RECOVERING.value, state=x.state.value, recovery=rec.number)
        x._record_quietly()
        x._event("job.recovered", step=x.completed, **rec.to_json(),
                 placement={s: {"worker": p.worker, "incarnation": p.incarnation, "devices": list(p.devices)}
                            for s, p in x.placement.items()})
        self.log.info("recovery.restored", **rec.to_json())
        x._grant()

    def _plan(self, policy: str, lost_slices: set[str], c: int, done_through: dict[str, int],
              rec: RecoveryRecord) -> ReplayPlan:
        x = self.x
        if policy == "partial":
            survivors = {n.name for n in x.graph.nodes if n.slice not in lost_slices}
            plan = plan_replay(x.graph, lost_slices=lost_slices, checkpoint_step=c,
                               log_from={n: min(x.cut, done_through[n]) for n in survivors}, done_through=done_through)
            pulled = sorted(n for n in plan.pulled_in if n in survivors)
            if not pulled:
                return plan
            rec.escalated = (f"nodes {pulled} of surviving slices would have to re-run from step {c} (their output "
                             "logs do not reach back that far): every slice restarts from the cut")
            self.log.warning("recovery.escalated", reason=rec.escalated)
        return restart_all_plan(x.graph, c, done_through, lost_slices=lost_slices)

    def _partial(self, plan: ReplayPlan, new_workers: set[str], commits: dict) -> None:
        x = self.x
        c = plan.checkpoint_step
        skip = None
        if os.environ.get(BREAK_REPLAY_ENV):  # a deliberately broken recovery: no replay (the chaos suite's test)
            skip = min((r.to_step for r in plan.nodes.values() if r.slice in plan.lost_slices), default=c)
            self.log.warning("recovery.replay_disabled", env=BREAK_REPLAY_ENV, restored=c, starts_at=skip)
        self._check(x.load(new_workers, c, commits, start_override=skip))
        reqs = x.requests(None, c, commits)
        lost: dict[str, str] = {}
        for w in x.workers.workers:
            if w in new_workers:
                continue
            try:
                r = x.workers.rewire(w, reqs[w].routes if w in reqs else [], plan.nodes, c, x.granted)
                self.log.info("recovery.rewired", worker=w, resent=r.resent, log_from=r.log_from)
            except WorkerCallFailed as exc:
                if exc.code == grpc.StatusCode.OUT_OF_RANGE:
                    raise _Corrupt(str(exc)) from None  # the log does not reach back: restart-all from the cut
                if exc.code not in LOST_CODES:
                    raise _Refused({w: str(exc)}) from None
                lost[w] = str(exc)
        if lost:
            raise _Lost(lost)

    def _drop_commit(self, error: str) -> None:
        """A checkpoint that does not restore stops counting: its commit goes (and is reported)."""
        m = re.search(r"corrupt checkpoint slice=(\S+) step=(\d+)", error)
        if m is None:
            return
        x = self.x
        slice_name, step = m[1], int(m[2])
        x.until_etcd("dropping a corrupt commit", lambda: x.election.fenced_txn(
            [], [Delete(x.keys.checkpoint(x.spec.job, slice_name, step))], []))
        if x.run_dir is not None:
            commit_record_path(x.run_dir, slice_name, step).unlink(missing_ok=True)
        x.corrupt.append({"slice": slice_name, "step": step, "error": error})
        self.log.warning("checkpoint.decommitted", slice=slice_name, step=step)

    @staticmethod
    def _check(failed: dict[str, WorkerCallFailed]) -> None:
        corrupt = [f for f in failed.values() if f.code == grpc.StatusCode.DATA_LOSS]
        if corrupt:
            raise _Corrupt(str(corrupt[0]))
        lost = {w: str(f) for w, f in failed.items() if f.code in LOST_CODES}
        if lost:
            raise _Lost(lost)
        if failed:
            raise _Refused({w: str(f) for w, f in failed.items()})

    def _registered(self, worker: str) -> bool:
        """Whether the incarnation the job placed on ``worker`` is still registered in etcd."""
        x = self.x
        incarnations = {p.incarnation for p in x.placement.values() if p.worker == worker}
        kv = x.until_etcd(f"reading worker {worker}", lambda: x.store.get(x.keys.worker(worker)))
        return kv is not None and kv.create_revision in incarnations


class _Corrupt(Exception):
    """A checkpoint of the cut did not restore."""


class _Refused(Exception):
    """Workers refused a load or rewire: lost if their incarnation ended, else asked again."""

    def __init__(self, failed: dict[str, str]) -> None:
        super().__init__("; ".join(failed.values()))
        self.failed = failed


class _Lost(Exception):
    def __init__(self, lost: dict[str, str]) -> None:
        super().__init__(str(lost))
        self.lost = lost
