"""Submitting a compiled program to a cluster's leader coordinator and following it."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from rallypoint.client.compile import CompiledProgram
from rallypoint.client.jobspec import job_spec
from rallypoint.client.reference import RunResult, state_digest
from rallypoint.etcd.errors import RallypointError
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import EtcdStore
from rallypoint.proto import codec
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc


class JobError(RallypointError):
    """The job failed on the cluster; the message is the coordinator's reason."""


def leader_address(endpoints: Sequence[str], cluster: str, *, wait_s: float = 15.0) -> str:
    """The gRPC address of the cluster's leader coordinator (waits for an election)."""
    store = EtcdStore(endpoints)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            kv = store.get(Keys(cluster).leader)
            if kv is not None and kv.json().get("address"):
                return str(kv.json()["address"])
            if time.monotonic() > deadline:
                raise RallypointError(
                    f"cluster {cluster!r} has no leader coordinator (waited {wait_s:.0f}s); "
                    "check `rallypoint workers` and the coordinators' logs"
                )
            time.sleep(0.2)
    finally:
        store.close()


def leader_stream(endpoints: Sequence[str], cluster: str, call: Callable[[Any], Iterator[pb.JobEvent]], *,
                  wait_s: float = 15.0) -> tuple[str, Iterator[pb.JobEvent], grpc.Channel]:
    """Open ``call`` (a Coordinator RPC streaming job events) on the leader.

    A leader that just died still owns the leader key until its lease expires: while
    the leader refuses connections before its first event, ask etcd again (up to ``wait_s``).
    Returns the leader's address, the stream (its first event put back in front) and the channel.
    """
    deadline = time.monotonic() + wait_s
    while True:
        address = leader_address(endpoints, cluster, wait_s=wait_s)
        channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        stream = call(pb_grpc.CoordinatorStub(channel))
        try:
            first = next(stream)
        except StopIteration:
            return address, iter(()), channel
        except grpc.RpcError as exc:
            channel.close()
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            continue
        return address, itertools.chain([first], stream), channel


RECOVERY_SUMMARY = ("failures", "recoveries", "replayed_instances", "redone_s", "compute_s", "output_log_peak",
                    "corrupt_checkpoints")


def submit(
    compiled: CompiledProgram, *, endpoints: Sequence[str], cluster: str, window: int = 2,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    on_event: Callable[[pb.JobEvent], None] | None = None, **recovery: Any,
) -> RunResult:
    """Run ``compiled`` on the cluster; return its final state and digest.

    ``recovery``: the job's recovery settings (:data:`rallypoint.client.jobspec.RECOVERY_FIELDS`).

    Raises:
        JobError: the job failed (the reason names what went wrong).
    """
    spec = job_spec(compiled, window=window, **recovery)
    t0 = time.perf_counter()
    metrics_log: list[dict[str, float]] = []

    def step(s: int, metrics: dict[str, float]) -> None:
        metrics_log.append(metrics)
        if on_step is not None:
            on_step(s, metrics)

    ev = _follow(spec.job, endpoints, cluster, lambda stub: stub.SubmitJob(spec), on_step=step, on_event=on_event)
    states = _states(compiled, ev.states)
    detail = json.loads(ev.detail or "{}")
    digest = state_digest(states)
    if detail.get("state_digest") and detail["state_digest"] != digest:
        raise JobError(f"job {spec.job!r}: the coordinator's state digest {detail['state_digest']} differs "
                       f"from the one of the states it sent ({digest})")
    return RunResult(spec.job, spec.steps, states, digest, time.perf_counter() - t0, metrics_log,
                     recovery={k: detail[k] for k in RECOVERY_SUMMARY if k in detail})


def _follow(job: str, endpoints: Sequence[str], cluster: str, call: Callable[[Any], Iterator[pb.JobEvent]], *,
            on_step: Callable[[int, dict[str, float]], None] | None,
            on_event: Callable[[pb.JobEvent], None] | None) -> pb.JobEvent:
    """Follow a job's event stream from the leader to its ``job.finished`` event.

    Raises:
        JobError: the job failed, or the coordinator failed or left before it ended.
    """
    address, channel = "the leader", None
    try:
        address, events, channel = leader_stream(endpoints, cluster, call)
        for ev in events:
            if on_event is not None:
                on_event(ev)
            if ev.event == "step.done" and on_step is not None:
                on_step(ev.step, dict(ev.metrics))
            elif ev.event == "job.failed":
                raise JobError(f"job {job!r} failed: {json.loads(ev.detail or '{}').get('reason', 'unknown')}")
            elif ev.event == "job.finished":
                return ev
    except grpc.RpcError as exc:
        raise JobError(f"job {job!r}: the coordinator at {address} answered {exc.code().name}: {exc.details()}") from None
    finally:
        if channel is not None:
            channel.close()
    raise JobError(f"job {job!r}: the coordinator closed the stream before the job ended")


def _states(compiled: CompiledProgram, values: Sequence[pb.StateValue]) -> dict[str, Any]:
    states = {}
    for v in values:
        cs = compiled.states[v.state]
        states[v.state] = cs.tree.unflatten([codec.from_tensor(t) for t in v.leaves])
    missing = set(compiled.states) - set(states)
    if missing:
        raise JobError(f"the final state lacks {sorted(missing)}")
    return states


def resume(
    job: str, *, endpoints: Sequence[str], cluster: str, checkpoint_dir: str = "",
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    on_event: Callable[[pb.JobEvent], None] | None = None,
) -> dict[str, Any]:
    """Resume ``job`` from its newest consistent cut; return its ``job.finished`` detail
    (``state_digest`` computed by the coordinator, ``start_step``, the recovery summary).

    Raises:
        JobError: the job could not be resumed or failed.
    """
    ev = _follow(job, endpoints, cluster,
                 lambda stub: stub.ResumeJob(pb.ResumeRequest(job=job, checkpoint_dir=checkpoint_dir)),
                 on_step=on_step, on_event=on_event)
    return {"job": job, "steps": int(ev.step), **json.loads(ev.detail or "{}")}
