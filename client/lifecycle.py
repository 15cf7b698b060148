"""A job's life from a client that does not stay: submit and walk away, watch again, cancel, suspend.

* :func:`submit_detached` submits (``SubmitJob``, with an idempotency key) and returns once
  the job runs (``job.started``: placed and loaded), with its name, run id and placement.
* :func:`watch` follows a job from now to its end (``WatchJob``, through leader changes,
  like :func:`~rallypoint.client.submission.submit`); its first event, ``job.watching``, says
  what happened before (its run, recoveries and drains).
* :func:`control` asks the leader to cancel or suspend a job (``CancelJob`` / ``SuspendJob``);
  the reply comes once the request is taken, the job stops at its next step boundary.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from rallypoint.etcd.records import parsed
from rallypoint.basics.errors import StoreError
from rallypoint.basics.tls import channel as tls_channel
from rallypoint.basics.tls import tls_of
from rallypoint.client.compile import CompiledProgram
from rallypoint.client.jobspec import job_spec
from rallypoint.client.submission import FOLLOW_S, JobError, JobFollower, JobStoppedError, ended
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.etcd_store import CLIENT_CONNECT_WAIT_S, EtcdStore
from rallypoint.orchestrator.api import END_EVENTS
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc

CONTROL_WAIT_S = 15.0  # how long cancel and suspend look for a leader that answers


def submit_detached(compiled: CompiledProgram, *, endpoints: Sequence[str], cluster: str, window: int = 0,
                    new_run: bool = False, code_dir: str | None = None, submit_id: str = "",
                    on_event: Callable[[pb.JobEvent], None] | None = None, **recovery: Any) -> dict[str, Any]:
    """Submit ``compiled`` and return once it runs: ``{"job", "run", "placement", "submit_id"}``.

    Raises:
        JobError: the job was refused, or failed or stopped before it ran.
    """
    spec = job_spec(compiled, window=window, code_dir=code_dir, **recovery)
    spec.new_run = new_run
    spec.submit_id = submit_id or uuid.uuid4().hex
    return _until_started(spec.job, endpoints, cluster, lambda stub: stub.SubmitJob(spec), on_event) | {
        "submit_id": spec.submit_id}


def resume_detached(job: str, *, endpoints: Sequence[str], cluster: str, checkpoint_dir: str = "",
                    on_event: Callable[[pb.JobEvent], None] | None = None) -> dict[str, Any]:
    """``rallypoint resume --detach``: resume ``job`` and return once it runs (as :func:`submit_detached`)."""
    return _until_started(job, endpoints, cluster, lambda stub: stub.ResumeJob(
        pb.ResumeRequest(job=job, checkpoint_dir=checkpoint_dir)), on_event)


def _running(ev: pb.JobEvent) -> bool:
    """The job runs (``job.started``; a retried submit or resume watching it: ``job.watching`` past its loading),
    or it ended."""
    if ev.event == "job.watching":
        return json.loads(ev.detail or "{}").get("state") not in ("placing", "loading")
    return ev.event == "job.started" or ev.event in END_EVENTS


def _until_started(job: str, endpoints: Sequence[str], cluster: str, call: Callable[[Any], Any],
                   on_event: Callable[[pb.JobEvent], None] | None) -> dict[str, Any]:
    follower = JobFollower(job, endpoints, cluster, on_event=on_event, until=_running)
    ev = follower.follow(call)
    if ev.event == "job.finished":  # it ran to its end before the stream said it started (a resume at its end)
        return {"job": job, "run": json.loads(ev.detail or "{}").get("run", ""), "placement": {}, "finished": True}
    ended(ev)
    d = json.loads(ev.detail or "{}")
    placement = {s: {"worker": p.get("worker"), "devices": p.get("devices")} for s, p in d.get("placement", {}).items()}
    return {"job": job, "run": d.get("run", ""), "placement": placement, "step": int(ev.step)}


def watch(job: str, *, endpoints: Sequence[str], cluster: str,
          on_step: Callable[[int, dict[str, float]], None] | None = None,
          on_event: Callable[[pb.JobEvent], None] | None = None, follow_s: float = FOLLOW_S) -> pb.JobEvent:
    """Follow ``job`` to its end; return the end event (``job.finished`` carries the final state). A job
    suspended for a higher-priority one is waited for (the leader resumes it once room returns) and followed on.

    Raises:
        JobError: the leader has no such job running, or the job failed.
        JobStoppedError: it was suspended or cancelled.
    """
    while True:
        follower = JobFollower(job, endpoints, cluster, on_event=on_event, on_step=on_step, follow_s=follow_s)
        ev = follower.follow(lambda stub: stub.WatchJob(pb.WatchJobRequest(job=job)))
        try:
            ended(ev)
            return ev
        except JobStoppedError as exc:
            if not exc.resumes_by_itself:  # the end event says so: the record may have moved on since
                raise
        # Suspended for a higher-priority job: the leader resumes it once room returns; follow it then.
        _until_resumed(job, endpoints, cluster)


def _record(store: EtcdStore, job: str, cluster: str) -> dict[str, Any]:
    kv = store.get(Keys(cluster).job(job))
    return parsed(kv, "job") or {}


def _resumes_by_itself(r: dict[str, Any]) -> bool:
    """The job record ``r`` is suspended for a higher-priority job: the leader resumes it once room returns."""
    return r.get("state") == "suspended" and bool((r.get("stop") or {}).get("auto_resume"))


def _until_resumed(job: str, endpoints: Sequence[str], cluster: str, poll_s: float = 0.5) -> None:
    """Wait until the job's record no longer waits for the leader to resume it (it resumed it; an operator
    cancelled it, or suspended it for good: the next watch ends with that)."""
    store = EtcdStore(list(endpoints), connect_wait_s=CLIENT_CONNECT_WAIT_S)
    try:
        while True:
            try:
                if not _resumes_by_itself(_record(store, job, cluster)):
                    return
            except StoreError:
                pass  # etcd away a moment: ask again
            time.sleep(poll_s)
    finally:
        store.close()


def control(job: str, action: str, *, endpoints: Sequence[str], cluster: str, checkpoint: bool = False,
            by: str = "", reason: str = "", wait_s: float = CONTROL_WAIT_S) -> pb.JobControlReply:
    """Ask the leader to ``"cancel"`` or ``"suspend"`` ``job``; the reply once the request is taken.

    Retried while there is no leader or it moves; a refusal (the job is over, asked already, keeps no
    checkpoints) raises at once.

    Raises:
        JobError: the leader refused (its reason, which says what to do), or none answered in ``wait_s``.
    """
    request = pb.JobControlRequest(job=job, checkpoint=checkpoint, by=by, reason=reason)
    store = EtcdStore(list(endpoints), connect_wait_s=CLIENT_CONNECT_WAIT_S)
    deadline, last = time.monotonic() + wait_s, "no leader in etcd"
    try:
        while True:
            try:
                kv = store.get(Keys(cluster).leader)
            except StoreError as exc:
                kv, last = None, f"etcd unreachable: {exc}"
            address = str((parsed(kv, "leader") or {}).get("address", ""))
            if address:
                ch = tls_channel(address, tls_of(store))
                try:
                    stub = pb_grpc.CoordinatorStub(ch)
                    method = stub.CancelJob if action == "cancel" else stub.SuspendJob
                    return method(request, timeout=10.0)
                except grpc.RpcError as exc:
                    code, last = exc.code(), f"{exc.code().name}: {exc.details()}"
                    moving = code == grpc.StatusCode.UNAVAILABLE or (
                        code == grpc.StatusCode.FAILED_PRECONDITION and "does not lead" in (exc.details() or ""))
                    if not moving:
                        raise JobError(f"cannot {action} job {job!r}: {exc.details()}") from None
                finally:
                    ch.close()
            if time.monotonic() > deadline:
                raise JobError(f"cannot {action} job {job!r}: no leader answered within {wait_s:.0f}s (last: {last})")
            time.sleep(0.25)
    finally:
        store.close()
