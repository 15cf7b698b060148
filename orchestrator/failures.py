"""Failure classification, in one place.

Raw errors from the links to workers are turned into a :class:`Verdict`:

- ``LOST``: the worker process is gone (its socket refuses or was reset). The
  coordinator fences it at once by revoking its lease: the fast path.
- ``SUSPECT``: no answer in time, or an ambiguous transport error. Nothing is
  done on it; the worker's etcd lease decides (a hang or partition expires it).
- ``REFUSED``: the worker answered but refused (fenced, or a stale incarnation).
  Its lease decides as well.
- ``NOT_OURS``: our own cancellation or shutdown.
"""

from __future__ import annotations

import enum

import grpc


class Verdict(enum.Enum):
    LOST = "lost"
    SUSPECT = "suspect"
    REFUSED = "refused"
    NOT_OURS = "not_ours"


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
# Codes on which only the lease can tell.
AMBIGUOUS_CODES: frozenset[grpc.StatusCode] = frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
)


def classify_rpc_error(code: grpc.StatusCode, details: str | None) -> Verdict:
    """Classify an RPC failure on a link to a worker."""
    text = (details or "").lower()
    if code is grpc.StatusCode.CANCELLED:
        return Verdict.NOT_OURS
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return Verdict.REFUSED
    if code is grpc.StatusCode.UNAVAILABLE and any(m in text for m in PROCESS_GONE_MARKERS):
        return Verdict.LOST
    if code in AMBIGUOUS_CODES or code is grpc.StatusCode.UNAVAILABLE:
        return Verdict.SUSPECT
    return Verdict.SUSPECT
