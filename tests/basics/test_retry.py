"""basics/retry.py: tenacity on an injected clock: backoff, deadline, stop condition, what is retried."""

from __future__ import annotations

import pytest

from rallypoint.basics.clock import FakeClock
from rallypoint.basics.errors import ConfigError, StoreUnavailable
from rallypoint.basics.retry import retrying


class Flaky:
    def __init__(self, failures: int, exc: Exception | None = None) -> None:
        self.failures, self.calls, self.exc = failures, 0, exc or StoreUnavailable("etcd away")

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return "ok"


def test_retries_transient_errors_with_bounded_backoff_on_the_injected_clock() -> None:
    clock = FakeClock()
    t0 = clock.monotonic()
    f = Flaky(5)
    assert retrying(clock=clock, what="x", initial_s=0.1, max_s=0.4, jitter_s=0.0)(f) == "ok"
    assert f.calls == 6
    assert clock.monotonic() - t0 == pytest.approx(0.1 + 0.2 + 0.4 + 0.4 + 0.4)  # doubling, capped


def test_gives_up_at_the_deadline_and_reraises_the_last_error() -> None:
    clock = FakeClock()
    f = Flaky(10**6)
    with pytest.raises(StoreUnavailable, match="etcd away"):
        retrying(clock=clock, what="x", stop_after_s=5.0, max_s=1.0)(f)
    assert 5 <= f.calls <= 12


def test_stops_when_told_and_never_retries_other_errors() -> None:
    clock = FakeClock()
    f = Flaky(10**6)
    with pytest.raises(StoreUnavailable):
        retrying(clock=clock, what="x", should_stop=lambda: f.calls >= 3)(f)
    assert f.calls == 3
    g = Flaky(1, ConfigError("bad setting"))
    with pytest.raises(ConfigError):
        retrying(clock=clock, what="x")(g)
    assert g.calls == 1
    h = Flaky(10**6)
    with pytest.raises(StoreUnavailable):
        retrying(clock=clock, what="x", max_attempts=4)(h)
    assert h.calls == 4


def test_retries_while_the_result_is_not_good_yet_and_returns_the_last_one() -> None:
    clock = FakeClock()
    answers = iter([None, None, 7])
    assert retrying(clock=clock, what="x", retry_if_result=lambda r: r is None)(lambda: next(answers)) == 7
    assert retrying(clock=clock, what="x", retry_if_result=lambda r: r is None, stop_after_s=2.0)(lambda: None) is None


def test_one_set_of_transient_rpc_codes_and_a_cancellation_is_never_one_of_them() -> None:
    import grpc

    from rallypoint.basics.retry import TRANSIENT_RPC_CODES, transient_rpc

    class Failed(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode) -> None:
            self._code = code

        def code(self) -> grpc.StatusCode:
            return self._code

    assert grpc.StatusCode.CANCELLED not in TRANSIENT_RPC_CODES
    assert {c for c in grpc.StatusCode if transient_rpc(Failed(c))} == set(TRANSIENT_RPC_CODES)
    assert not transient_rpc(ConnectionError("not an RPC"))
    clock = FakeClock()
    f = Flaky(3, Failed(grpc.StatusCode.UNAVAILABLE))
    assert retrying(clock=clock, what="x", retry_if=transient_rpc)(f) == "ok" and f.calls == 4
    g = Flaky(3, Failed(grpc.StatusCode.CANCELLED))
    with pytest.raises(grpc.RpcError):
        retrying(clock=clock, what="x", retry_if=transient_rpc)(g)
    assert g.calls == 1
