"""Tests for orchestrator.failures.classify_rpc_error."""

from __future__ import annotations

import grpc
import pytest

from rallypoint.orchestrator.failures import PROCESS_GONE_MARKERS, Verdict, classify_rpc_error

C = grpc.StatusCode


@pytest.mark.parametrize(
    ("code", "details", "verdict"),
    [
        # The peer process is gone: fence at once.
        (C.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
                        "ipv4:127.0.0.1:7001: Connection refused", Verdict.LOST),
        (C.UNAVAILABLE, "Socket closed", Verdict.LOST),
        (C.UNAVAILABLE, "Connection reset by peer", Verdict.LOST),
        (C.UNAVAILABLE, "Broken pipe", Verdict.LOST),
        (C.UNAVAILABLE, "recvmsg:Connection reset by peer", Verdict.LOST),
        # Slow or ambiguous: the lease decides.
        (C.DEADLINE_EXCEEDED, "Deadline Exceeded", Verdict.SUSPECT),
        (C.DEADLINE_EXCEEDED, "connection refused", Verdict.SUSPECT),  # only UNAVAILABLE means gone
        (C.UNAVAILABLE, "keepalive watchdog timeout", Verdict.SUSPECT),
        (C.UNAVAILABLE, None, Verdict.SUSPECT),
        (C.UNKNOWN, "Stream removed", Verdict.SUSPECT),
        (C.INTERNAL, "", Verdict.SUSPECT),
        (C.RESOURCE_EXHAUSTED, "too big", Verdict.SUSPECT),
        # The worker answered and refused (fenced or stale incarnation).
        (C.FAILED_PRECONDITION, "stale incarnation 12, current 15", Verdict.REFUSED),
        (C.FAILED_PRECONDITION, "socket closed", Verdict.REFUSED),
        # Our own cancellation.
        (C.CANCELLED, "Locally cancelled by application!", Verdict.NOT_OURS),
        (C.CANCELLED, "Socket closed", Verdict.NOT_OURS),
    ],
)
def test_classify_rpc_error(code: grpc.StatusCode, details: str | None, verdict: Verdict) -> None:
    assert classify_rpc_error(code, details) is verdict


@pytest.mark.parametrize("marker", sorted(PROCESS_GONE_MARKERS))
def test_every_process_gone_marker_is_lost_whatever_its_case(marker: str) -> None:
    assert classify_rpc_error(C.UNAVAILABLE, f"prefix: {marker.upper()} (errno)") is Verdict.LOST
