"""Retries, in one shape: tenacity with bounded jittered backoff, driven by an injected clock.

Every retry in Rallypoint is one of these, so each one waits on the clock it was given
(a :class:`~rallypoint.basics.clock.FakeClock` in tests: no real waiting), backs off with
jitter up to a bound, stops on a deadline of that clock or on a condition, and logs
each retry with its count. The last error is re-raised unchanged when it stops.

An RPC to a peer is worth retrying on :data:`TRANSIENT_RPC_CODES` (:func:`transient_rpc`),
the one set every retry of a call between workers uses (pushes of values, copies of
checkpoints). A cancellation is never retried: it is ours (the job was unloaded, the
process stops).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import tenacity
from tenacity import RetryCallState, Retrying, retry_if_exception, retry_if_exception_type, wait_exponential, wait_random

from rallypoint.basics.clock import Clock
from rallypoint.basics.errors import StoreUnavailable


TRANSIENT_RPC_CODES: frozenset[grpc.StatusCode] = frozenset({
    grpc.StatusCode.UNAVAILABLE,  # the peer unreachable, or restarting
    grpc.StatusCode.DEADLINE_EXCEEDED,  # slow
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # overloaded
    grpc.StatusCode.FAILED_PRECONDITION,  # a fence, which lifts when etcd answers again and the lease is alive
})


def transient_rpc(exc: BaseException) -> bool:
    """Whether ``exc`` is an RPC failure worth another attempt (:data:`TRANSIENT_RPC_CODES`)."""
    return isinstance(exc, grpc.RpcError) and exc.code() in TRANSIENT_RPC_CODES


class _Stop:
    """Stop once the clock passes ``deadline`` or ``should_stop()`` says so."""

    def __init__(self, clock: Clock, deadline: float | None, should_stop: Callable[[], bool] | None,
                 max_attempts: int | None) -> None:
        self.clock, self.deadline, self.should_stop, self.max_attempts = clock, deadline, should_stop, max_attempts

    def __call__(self, state: RetryCallState) -> bool:
        if self.max_attempts is not None and state.attempt_number >= self.max_attempts:
            return True
        if self.deadline is not None and self.clock.monotonic() >= self.deadline:
            return True
        return self.should_stop is not None and self.should_stop()


def retrying(
    *,
    clock: Clock,
    what: str,
    log: Any = None,
    retry_on: type[BaseException] | tuple[type[BaseException], ...] = StoreUnavailable,
    retry_if: Callable[[BaseException], bool] | None = None,
    retry_if_result: Callable[[Any], bool] | None = None,
    stop_after_s: float | None = None,
    should_stop: Callable[[], bool] | None = None,
    max_attempts: int | None = None,
    initial_s: float = 0.1,
    max_s: float = 1.0,
    jitter_s: float = 0.05,
    before_sleep: Callable[[RetryCallState], None] | None = None,
) -> Retrying:
    """A tenacity ``Retrying`` for ``what``: call it with the function to retry.

    Args:
        clock: its ``sleep`` does the waiting and its ``monotonic`` the deadline.
        what: what is retried, for the log.
        log: a structlog logger; each retry logs ``retry`` with ``what``, the attempt and the error.
        retry_on: the exceptions worth retrying (others propagate at once).
        retry_if: instead of ``retry_on``, says of each exception whether it is worth retrying
            (e.g. :func:`transient_rpc`).
        retry_if_result: also retry while this says the result is not good yet; when it
            stops, the last result is returned (not raised).
        stop_after_s: give up this long after the first attempt (None: no deadline).
        should_stop: give up as soon as this returns True (e.g. a stop event is set).
        max_attempts: give up after this many attempts (None: no limit).
        initial_s, max_s, jitter_s: the backoff: ``initial_s * 2**n`` capped at ``max_s``, plus jitter.
        before_sleep: called before each wait, after the log line.
    """
    deadline = clock.monotonic() + stop_after_s if stop_after_s is not None else None

    def _before_sleep(state: RetryCallState) -> None:
        if log is not None:
            exc = state.outcome.exception() if state.outcome is not None else None
            if state.attempt_number == 1 or state.attempt_number % 10 == 0:
                log.warning("retry", what=what, attempt=state.attempt_number, error=str(exc),
                            limit_s=stop_after_s, max_attempts=max_attempts)
        if before_sleep is not None:
            before_sleep(state)

    retry = retry_if_exception(retry_if) if retry_if is not None else retry_if_exception_type(retry_on)
    if retry_if_result is not None:
        retry = retry | tenacity.retry_if_result(retry_if_result)
    return Retrying(
        retry=retry,
        retry_error_callback=(lambda state: state.outcome.result()) if retry_if_result is not None else None,
        wait=wait_exponential(multiplier=initial_s, max=max_s) + wait_random(0, jitter_s),
        stop=_Stop(clock, deadline, should_stop, max_attempts),
        sleep=clock.sleep,
        before_sleep=_before_sleep,
        reraise=True,
    )
