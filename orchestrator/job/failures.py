"""Failure classification, in one place: every RPC failure toward a worker gets one
:class:`~rallypoint.recovery.decide.Verdict` here (the one a recovery's setback carries).

- ``LOST``: the worker process is gone (its socket refuses or was reset).
- ``SUSPECT``: no answer in time, or an ambiguous transport error: the worker may be
  hung, partitioned or slow. Only its etcd lease, or fencing it, can tell.
- ``REFUSED``: the worker answered and refused (fenced, a stale incarnation or term,
  a job it does not hold, storage that refused).
- ``CORRUPT``: a checkpoint it was to restore did not read back (DATA_LOSS, with the
  slice and step as a typed error in the call's metadata: :mod:`rallypoint.proto.errors`).
- ``LOG_SHORT``: its output log no longer reaches back to the step asked for (OUT_OF_RANGE).
- ``INVALID``: the request itself is wrong (INVALID_ARGUMENT): a bug, retrying cannot help.
- ``PROGRAM``: the job's own program failed on the worker, deterministically (an exception
  in an init, an XLA compile error, out of device memory, a shape error: the worker says
  so as a typed error in the call's metadata, :mod:`rallypoint.proto.errors`). No worker
  is to blame: the job fails, naming the part, the worker and the error.
- ``CANCELLED``: a cancellation (ours, or the server's as it shuts down). Never a
  suspicion: a recovery asks again, and fences only a worker whose registration is gone.

A worker that leads a multi-host slice and answers that a member of it was lost meanwhile
(ABORTED, with the member's worker as a typed error, ``member_lost``) keeps the verdict of its
code: it is alive. The caller reads :attr:`WorkerCallFailed.member_lost` and recovers the slice.

What to *do* on a verdict is the caller's policy, and each is explicit: the leader's
link to a worker fences on ``LOST`` and lets the lease decide on ``SUSPECT``; a job's
executor recovers on ``LOST``; a recovery in progress decides through
:func:`rallypoint.recovery.decide.decide` (a ``SUSPECT`` worker is fenced there:
fencing first keeps it safe, a worker that was only slow comes back as a new incarnation).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from rallypoint.proto.errors import CorruptCheckpoint, MemberLost, ProgramFailure, parse_error
from rallypoint.recovery.decide import Verdict


# Transport messages that mean the peer process is gone, not merely slow.
PROCESS_GONE_MARKERS: frozenset[str] = frozenset(
    {
        "connection refused",
        "connection reset",
        "socket closed",
        "broken pipe",
        "end of tcp stream",
        "failed to connect to all addresses",
    }
)


def classify_rpc_error(code: grpc.StatusCode, details: str | None) -> Verdict:
    """Classify an RPC failure toward a worker from its status code and message."""
    text = (details or "").lower()
    if code is grpc.StatusCode.CANCELLED:
        return Verdict.CANCELLED
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return Verdict.REFUSED
    if code is grpc.StatusCode.DATA_LOSS:
        return Verdict.CORRUPT
    if code is grpc.StatusCode.OUT_OF_RANGE:
        return Verdict.LOG_SHORT
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return Verdict.INVALID
    if code is grpc.StatusCode.UNAVAILABLE and any(m in text for m in PROCESS_GONE_MARKERS):
        return Verdict.LOST
    return Verdict.SUSPECT  # DEADLINE_EXCEEDED, other UNAVAILABLE, UNKNOWN, INTERNAL, ...


class WorkerCallFailed(Exception):
    """An RPC to one worker failed: its code, message, :class:`Verdict` and typed error, if any."""

    def __init__(self, worker: str, what: str, code: grpc.StatusCode, details: str,
                 metadata: Iterable[Any] | None = None) -> None:
        super().__init__(f"worker {worker}: {what} failed: {code.name} {details}")
        self.worker, self.what, self.code, self.details = worker, what, code, details
        self.verdict = classify_rpc_error(code, details)
        typed = parse_error(metadata)
        self.corrupt: CorruptCheckpoint | None = typed if self.verdict is Verdict.CORRUPT and isinstance(
            typed, CorruptCheckpoint) else None
        self.program: ProgramFailure | None = None
        if code is grpc.StatusCode.INTERNAL and isinstance(typed, ProgramFailure):
            self.verdict, self.program = Verdict.PROGRAM, typed
        # the worker (alive) leads a multi-host slice that lost a member meanwhile: the member's loss, the caller's
        self.member_lost: MemberLost | None = typed if isinstance(typed, MemberLost) else None

    @classmethod
    def from_rpc_error(cls, worker: str, what: str, exc: BaseException) -> WorkerCallFailed:
        """From what a gRPC call raised (a non-RPC exception counts as UNKNOWN: suspect)."""
        if isinstance(exc, grpc.RpcError):
            call: Any = exc
            metadata = call.trailing_metadata() if hasattr(call, "trailing_metadata") else None
            return cls(worker, what, call.code(), call.details() or "", metadata)
        return cls(worker, what, grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")
