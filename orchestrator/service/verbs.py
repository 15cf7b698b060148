"""The leader's verbs on a job's life: cancel, suspend, the resume of a job set aside for a
higher-priority one, and how long the history of ended jobs is kept.

The job service (:mod:`~rallypoint.orchestrator.service.jobs`) answers ``CancelJob`` and
``SuspendJob`` here (:meth:`JobControl.stop`). A request is checked against the job's
state first, and a refused one changes nothing:

* a job that is over (succeeded, failed, cancelled) or already asked to stop: refused
  (FAILED_PRECONDITION) with the state and what can be done instead;
* a suspend, or a cancel with ``checkpoint``, of a job without checkpoints: refused, it
  could never be resumed;
* a cancel of a SUSPENDED job: the record moves to CANCELLED at once (nothing runs);
* otherwise the request is written to ``control/<job>`` (a fenced write of the leader;
  only one request at a time, by a compare on the key) and handed to the job's executor,
  which carries it out at its next step boundary (:mod:`~rallypoint.orchestrator.job.stop`).
  A job recorded as running that this leader has not adopted yet gets it when it is
  adopted. The reply comes at once; ``rallypoint cancel`` then follows the job to its end.

**Priority suspends.** A job that a higher-priority one asks to yield every slice it
holds is suspended instead of parked slice by slice (:meth:`JobDrains._poll_yields`):
its record says ``stop.by`` (the job and its priority) and ``stop.auto_resume``. The
leader's :class:`AutoResume` loop looks at such jobs every :data:`AUTO_RESUME_POLL_S`:
once no yield request for the job is left by a job still running, and the free devices
hold every slice (at one of its device counts), it resumes the job as ``rallypoint
resume`` would (``job.resumed`` with ``auto: true`` in its events and log).

**History.** Ended jobs' records (succeeded, failed, cancelled; a suspended job is
pending work and stays) and earlier runs' records stay in etcd for
``keep_history_s`` after their end, for ``rallypoint jobs``; then the leader's sweep
(:func:`expired`) removes them and their commits from etcd. Run directories stay: they
go by ``--keep-runs`` or ``rallypoint delete-run``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import grpc

from rallypoint.basics import authz
from rallypoint.basics.errors import NotLeader, RallypointError, StoreError
from rallypoint.etcd.cluster_view import ClusterSnapshot, parse_job_records, read_cluster
from rallypoint.etcd.keys import check_name
from rallypoint.etcd.records import BadRecord, Fields, parsed
from rallypoint.etcd.store import Compare, Delete, KeyValue, Put
from rallypoint.orchestrator.control.devices import choose_gang
from rallypoint.orchestrator.job.state import FINAL_RECORD_STATES, JobState, JobStateError, record_transition
from rallypoint.orchestrator.job.stop import StopRequest, stop_request
from rallypoint.orchestrator.job.view import JobHandle, JobView
from rallypoint.recovery.load_plan import device_counts
from rallypoint.orchestrator.job.runs import adoptable_run_dir, check_spec_names, read_spec, run_of
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.remap import Remap, RemapPolicy, Shrink, plan_remap
from rallypoint.recovery.slices import slice_devices

AUTO_RESUME_POLL_S = 1.0  # how often the leader looks for suspended jobs to resume by themselves
HISTORY_SWEEP_S = 60.0  # how often the leader removes expired history
DEFAULT_KEEP_HISTORY_S = 7 * 86400.0  # CoordinatorConfig.keep_history_s
ENDED = frozenset({JobState.SUCCEEDED.value, JobState.FAILED.value, JobState.CANCELLED.value})


def _past(action: str) -> str:
    return "suspended" if action == "suspend" else "cancelled"


class RunningJob(Protocol):
    """A job the service runs now, as the verbs see it: its executor."""

    @property
    def executor(self) -> JobHandle: ...


class JobService(Protocol):
    """What the verbs need of the coordinator's job service (:class:`~rallypoint.orchestrator.service.jobs.CoordinatorService`)."""

    c: Any  # the coordinator: store, keys, election, config
    log: Any

    def running(self, job: str) -> RunningJob | None: ...

    def start_resumed(self, spec: pb.JobSpec, *, checkpoint_root: str, auto: bool) -> RunningJob | None: ...


class JobControl:
    """Cancel, suspend and the auto-resume of one coordinator's job service (see the module doc)."""

    def __init__(self, service: JobService) -> None:
        self.s, self.c, self.log = service, service.c, service.log

    # -- cancel and suspend ---------------------------------------------------------------------

    def stop(self, request: pb.JobControlRequest, action: str, context: grpc.ServicerContext) -> pb.JobControlReply:
        """``CancelJob`` (``action="cancel"``) or ``SuspendJob`` (``"suspend"``): checked, then kept and handed on."""
        job = request.job
        try:
            check_name("job", job)
        except RallypointError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot {action} job {job!r}: {exc}")
        store, keys = self.c.store, self.c.keys
        try:
            kv, asked = store.get(keys.job(job)), store.get(keys.control(job))
        except StoreError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read job {job!r}: {exc}; try again")
        run = self.s.running(job)
        view = run.executor.view() if run is not None else None
        record = parsed(kv, "job") or {}
        if run is None and kv is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"cluster {keys.cluster!r} has no job {job!r}; nothing changed "
                                                     "(`rallypoint jobs` lists the jobs)")
        caller = authz.peer_identity(context)  # None: plain TCP (--insecure), where nobody is known
        owner = view.owner if view is not None else str(record.get("owner", ""))
        if caller is not None and caller.partition(":")[0] == authz.CLIENT and caller != owner:
            self.log.warning("job.stop_refused", job=job, action=action, by=caller, owner=owner)
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"cannot {action} job {job!r}: it was submitted by {owner or 'nobody known'}, not by "
                          f"{caller}; a client stops only its own jobs (an operator's certificate stops any)")
        state = view.state.value if view is not None else str(record.get("state", ""))
        if state in ENDED or (state == JobState.SUSPENDED.value and action == "suspend"):
            then = {"cancelled": f"`rallypoint resume {job}` continues its run from its last cut",
                    "failed": f"`rallypoint resume {job}` continues its run from its last cut",
                    "suspended": f"`rallypoint resume {job}` brings it back",
                    "succeeded": "its run is complete"}.get(state, "")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {job!r} is already {state}: there is nothing to {action}; nothing changed ({then})")
        if asked is not None and state != JobState.SUSPENDED.value:  # (a suspended job's was carried out)
            prev = stop_request(asked.value, self.log)
            who = f" by {prev.by} at {time.strftime('%H:%M:%S', time.localtime(prev.at))}" if prev else ""
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {job!r} is already being {_past(prev.action) if prev else 'stopped'} (asked{who}); "
                          f"nothing changed: `rallypoint watch {job}` follows it")
        saves = action == "suspend" or request.checkpoint
        has_run_dir = (view.run_dir is not None) if view is not None else bool(record.get("run_dir"))
        if saves and not has_run_dir:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {job!r} keeps no checkpoints: a {'suspend' if action == 'suspend' else 'final cut'} "
                          f"needs them, and nothing changed; `rallypoint cancel {job}` (without --checkpoint) stops it")
        req = StopRequest(action, checkpoint=saves, by=caller or request.by or "an operator", reason=request.reason,
                          at=self.c.clock.wall())
        if state == JobState.SUSPENDED.value:  # a cancel of a job set aside: nothing runs, the record moves
            return self._cancel_suspended(job, record, kv.mod_revision if kv else 0, req, context)
        try:
            written = self.c.election.fenced_txn([Compare(keys.control(job), "version", "==", 0)],
                                                 [Put(keys.control(job), json.dumps(req.to_json()))])
        except NotLeader as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this coordinator no longer leads ({exc}); try again")
        except StoreError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot keep the request for job {job!r}: {exc}; try again")
        if not written.succeeded:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {job!r} was asked to stop by another request just now; nothing changed")
        if run is not None:
            run.executor.request_stop(req)
        self.log.warning("job.stop_asked", job=job, state=state, **req.to_json())
        where = "at its next step boundary" + (", every slice saved there" if saves else ", without a final checkpoint")
        return pb.JobControlReply(job=job, state=state, run=run_of(record) or (view.run_id if view else ""),
                                  message=f"job {job!r} ({state}) will be {_past(action)} {where}")

    def _cancel_suspended(self, job: str, record: dict[str, Any], revision: int, req: StopRequest,
                          context: grpc.ServicerContext) -> pb.JobControlReply:
        try:
            record_transition(record.get("state", ""), JobState.CANCELLED, job)
        except JobStateError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{exc}; nothing changed")
        now = self.c.clock.wall()
        new = {**record, "state": JobState.CANCELLED.value, "stop": req.to_json(), "ended_at": now,
               "at": now, "reason": f"cancelled while suspended by {req.by}"}
        keys = self.c.keys
        try:
            done = self.c.election.fenced_txn([Compare(keys.job(job), "mod", "==", revision)],
                                              [Put(keys.job(job), json.dumps(new))])
        except (NotLeader, StoreError) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot record the cancel of job {job!r}: {exc}; try again")
        if not done.succeeded:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {job!r} changed while it was cancelled (resumed just now?); nothing changed: try again")
        self.log.warning("job.cancelled", job=job, was="suspended", by=req.by)
        return pb.JobControlReply(job=job, state=JobState.CANCELLED.value, run=run_of(record),
                                  message=f"job {job!r} was suspended and is now cancelled; its run is kept "
                                          f"(`rallypoint resume {job}` continues it)")

    def refuse_settled(self, job: str, context: grpc.ServicerContext) -> None:
        """A resume of a job whose record says it succeeded is refused (its run is complete); one that is
        suspended, cancelled or failed goes on (:data:`job_state.RECORD_TRANSITIONS`), and a suspend or cancel
        still asked of it is withdrawn: the operator's resume is the newer word."""
        if self.s.running(job) is not None:
            return
        try:
            kv = self.c.store.get(self.c.keys.job(job))
        except StoreError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read the record of job {job!r}: {exc}")
        state = (parsed(kv, "job") or {}).get("state", "")
        if state in FINAL_RECORD_STATES:
            try:
                record_transition(state, JobState.PLACING, job)
            except JobStateError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"cannot resume: {exc} (its run is complete); nothing changed. `rallypoint run ... "
                              f"--new-run` starts the job over")
        try:
            self.c.election.fenced_txn([], [Delete(self.c.keys.control(job))])
        except (StoreError, NotLeader) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot withdraw the stop asked of job {job!r}: {exc}")

    # -- the resume of jobs a higher-priority job suspended -----------------------------------------

    def auto_resume(self, term: int, holds: Any) -> None:
        """The leader's loop for ``term`` (a thread): resume each job suspended for a higher-priority one once
        room returns; sweep expired history. ``holds()``: whether the term still leads here."""
        swept = float("-inf")
        while holds():
            try:
                self.resume_ready(term)
                if self.c.clock.monotonic() - swept >= HISTORY_SWEEP_S:
                    swept = self.c.clock.monotonic()
                    self.sweep_history()
            except (StoreError, NotLeader) as exc:
                self.log.warning("job.auto_resume_failed", error=str(exc))
            except Exception as exc:  # noqa: BLE001 - the loop must outlive one bad record
                self.log.exception("job.auto_resume_failed", error=repr(exc))
            time.sleep(AUTO_RESUME_POLL_S)

    def resume_ready(self, term: int) -> list[str]:
        """Resume every job suspended with ``auto_resume`` whose room has returned; the jobs resumed."""
        kvs, _ = self.c.store.get_prefix(self.c.keys.jobs)
        records, _bad = parse_job_records(kvs, self.c.keys)
        waiting = {j: r for j, r in records.items() if r.get("state") == JobState.SUSPENDED.value
                   and (r.get("stop") or {}).get("auto_resume") and self.s.running(j) is None}
        if not waiting:
            return []
        snap = read_cluster(self.c.store, self.c.keys)
        resumed = []
        for job, record in sorted(waiting.items(), key=lambda kv: (-int(kv[1].get("priority", 0)), kv[0])):
            why = self._not_yet(job, records, snap, record)
            if why:
                continue
            if self._resume(job, record, term):
                resumed.append(job)
                snap = read_cluster(self.c.store, self.c.keys)  # the next job sees what this one took
        return resumed

    def _not_yet(self, job: str, records: Mapping[str, dict[str, Any]], snap: ClusterSnapshot,
                 record: dict[str, Any]) -> str:
        """Why the job cannot resume yet ("" when it can); yield requests of jobs that ended are removed."""
        keys = self.c.keys
        kvs, _ = self.c.store.get_prefix(keys.job_yields(job))
        stale = []
        for kv in kvs:
            asker = str((parsed(kv, "yield") or {}).get("for", ""))
            if records.get(asker, {}).get("state", "") not in FINAL_RECORD_STATES:
                return f"job {asker!r} still asks for its devices"
            stale.append(Delete(kv.key))
        if stale:
            self.c.election.fenced_txn([], stale)
        spec = self._spec(job, record)
        if spec is None:
            return "its job spec cannot be read"
        return "" if room_to_resume(snap, spec) else "no room for its slices yet"

    def _spec(self, job: str, record: dict[str, Any]) -> pb.JobSpec | None:
        try:
            rd = adoptable_run_dir(str(record.get("run_dir") or ""), job, self.c.config.checkpoint_dir)
            spec = pb.JobSpec.FromString(read_spec(rd, record))  # bound to the record's spec_sha256
            check_spec_names(spec)
        except (OSError, ValueError, RallypointError) as exc:
            self.log.error("job.auto_resume_impossible", job=job, reason=str(exc))
            return None
        return spec if spec.job == job else None

    def _resume(self, job: str, record: dict[str, Any], term: int) -> bool:
        spec = self._spec(job, record)
        if spec is None or self.c.election.term != term:
            return False
        rd = Path(str(record["run_dir"]))
        run = self.s.start_resumed(spec, checkpoint_root=str(rd.parent.parent), auto=True)
        if run is not None:
            self.log.info("job.auto_resumed", job=job, suspended_by=(record.get("stop") or {}).get("by"))
        return run is not None

    # -- history ------------------------------------------------------------------------------------

    def sweep_history(self, now: float | None = None) -> list[str]:
        """Remove from etcd what :func:`expired` says is past ``keep_history_s``; the keys' prefixes removed."""
        keep = float(getattr(self.c.config, "keep_history_s", DEFAULT_KEEP_HISTORY_S))
        kvs, _ = self.c.store.get_prefix(self.c.keys.jobs)
        gone = expired(self.c.keys, {kv.key: rec for kv in kvs if (rec := _record(kv)) is not None}, keep,
                       self.c.clock.wall() if now is None else now)
        for prefix in gone:
            self.c.election.fenced_txn([], [Delete(prefix, prefix=prefix.endswith("/"))])
        if gone:
            self.log.info("job.history_expired", removed=gone, keep_history_s=keep)
        return gone


def watched(x: JobView) -> dict[str, Any]:
    """What happened to a job before a client watched it: its run, recoveries and drains, and a stop asked."""
    out: dict[str, Any] = {"run": x.run_id, "recoveries": x.recoveries_json(), "drains": x.drains_json()}
    if x.stop is not None:
        out["stop"] = x.stop.to_json()
    return out


def _record(kv: KeyValue) -> dict[str, Any] | None:
    """A record under ``jobs/`` as an object; None for a malformed one (a sweep skips it quietly: the job's
    readers report it)."""
    try:
        return Fields.of(kv, "job").raw
    except BadRecord:
        return None


def expired(keys: Any, records: Mapping[str, dict[str, Any]], keep_s: float, now: float) -> list[str]:
    """The etcd keys (a prefix ends in ``/``) of history past ``keep_s`` (0: kept for ever): a current record of
    an ended job (with its commits), or an earlier run's record (with its commits), ended before ``now - keep_s``."""
    if keep_s <= 0:
        return []
    out = []
    for key, r in sorted(records.items()):
        ended = r.get("ended_at") or r.get("superseded_at")
        if ended is None or now - float(ended) < keep_s:
            continue
        parts = keys.tail(key, keys.jobs)
        if len(parts) == 1 and r.get("state") in ENDED:  # jobs/<job>: the job's current run
            out += [keys.job(parts[0]), keys.checkpoints(parts[0])]
        elif len(parts) == 4 and parts[1] == "runs" and parts[3] == "record":  # jobs/<job>/runs/<run>/record
            out.append(f"{keys.runs(parts[0])}{parts[2]}/")
    return out


def room_to_resume(snap: ClusterSnapshot, spec: pb.JobSpec) -> bool:
    """Whether the free devices hold every slice of ``spec`` now, each at one of its device counts."""
    counts = device_counts(spec)
    need = {s: max(counts.get(s) or [max(1, n)]) for s, n in slice_devices(spec).items()}
    largest = max((w.info.devices for w in snap.workers.values()), default=0)
    single = {s: n for s, n in need.items() if min(counts.get(s) or [n]) <= largest}
    for s, n in need.items():
        if s not in single and choose_gang(snap, n) is None:
            return False
    if not single:
        return True
    allowed = {s: tuple(counts.get(s) or [n]) for s, n in single.items()}
    plan = plan_remap(snap, single, RemapPolicy(on_no_spare="shrink"), allowed=allowed)
    return isinstance(plan, (Remap, Shrink))


def start_thread(control: JobControl, term: int, holds: Any) -> threading.Thread:
    t = threading.Thread(target=control.auto_resume, args=(term, holds), name=f"auto-resume-{term}", daemon=True)
    t.start()
    return t
