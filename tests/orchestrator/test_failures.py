"""Tests for orchestrator.failures.classify_rpc_error."""

from __future__ import annotations

import grpc
import pytest

from rallypoint.orchestrator.job.failures import PROCESS_GONE_MARKERS, classify_rpc_error
from rallypoint.recovery.decide import Verdict

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
        (C.CANCELLED, "Locally cancelled by application!", Verdict.CANCELLED),
        (C.CANCELLED, "Socket closed", Verdict.CANCELLED),
    ],
)
def test_classify_rpc_error(code: grpc.StatusCode, details: str | None, verdict: Verdict) -> None:
    assert classify_rpc_error(code, details) is verdict


@pytest.mark.parametrize("marker", sorted(PROCESS_GONE_MARKERS))
def test_every_process_gone_marker_is_lost_whatever_its_case(marker: str) -> None:
    assert classify_rpc_error(C.UNAVAILABLE, f"prefix: {marker.upper()} (errno)") is Verdict.LOST


@pytest.mark.parametrize(
    ("code", "verdict"),
    [(C.DATA_LOSS, Verdict.CORRUPT), (C.OUT_OF_RANGE, Verdict.LOG_SHORT), (C.INVALID_ARGUMENT, Verdict.INVALID)],
)
def test_what_a_worker_refuses_for_a_reason_gets_its_own_verdict(code: grpc.StatusCode, verdict: Verdict) -> None:
    assert classify_rpc_error(code, "whatever the message says") is verdict


def test_a_corrupt_checkpoint_is_read_from_the_typed_error_not_the_message() -> None:
    from rallypoint.orchestrator.job.failures import WorkerCallFailed
    from rallypoint.proto.errors import ERROR_KEY, corrupt_checkpoint_metadata

    f = WorkerCallFailed("w1", "LoadJob", C.DATA_LOSS, "anything at all", corrupt_checkpoint_metadata("stage2", 40))
    assert f.verdict is Verdict.CORRUPT and f.corrupt is not None
    assert (f.corrupt.slice_name, f.corrupt.step) == ("stage2", 40)
    assert WorkerCallFailed("w1", "LoadJob", C.DATA_LOSS, "corrupt checkpoint slice=s step=4").corrupt is None
    assert WorkerCallFailed("w1", "LoadJob", C.DATA_LOSS, "x", ((ERROR_KEY, "not json"),)).corrupt is None
    assert WorkerCallFailed("w1", "LoadJob", C.UNAVAILABLE, "x", corrupt_checkpoint_metadata("s", 4)).corrupt is None


def test_the_programs_own_failure_is_read_from_the_typed_error_and_blames_no_worker() -> None:
    from rallypoint.orchestrator.job.failures import WorkerCallFailed
    from rallypoint.proto.errors import ERROR_KEY, ProgramFailure, program_failed_metadata

    meta = program_failed_metadata("state 'w' init", "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory")
    f = WorkerCallFailed("w1", "LoadJob", C.INTERNAL, "loading job 'j': state 'w' init failed on worker w1", meta)
    assert f.verdict is Verdict.PROGRAM and f.corrupt is None
    assert f.program == ProgramFailure("state 'w' init", "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory")
    # Without the typed error, INTERNAL is the worker's own failure: suspect, as before.
    assert WorkerCallFailed("w1", "LoadJob", C.INTERNAL, "state 'w' init failed").verdict is Verdict.SUSPECT
    assert WorkerCallFailed("w1", "LoadJob", C.INTERNAL, "x", ((ERROR_KEY, '{"kind": "program_failed"}'),)
                            ).verdict is Verdict.SUSPECT  # not understood: no part, no error
    # Only with INTERNAL: the typed error does not turn a lost or refused call into the program's.
    assert WorkerCallFailed("w1", "LoadJob", C.UNAVAILABLE, "Connection refused", meta).verdict is Verdict.LOST
    assert WorkerCallFailed("w1", "LoadJob", C.FAILED_PRECONDITION, "fenced", meta).verdict is Verdict.REFUSED
