"""Tests for etcd.lease: LocalFence and LeaseKeeper, on a fake clock and store."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import pytest

from rallypoint.basics.clock import FakeClock
from rallypoint.basics.errors import ConfigError, Fenced, StoreUnavailable
from rallypoint.etcd.lease import LeaseKeeper, LocalFence, default_margin_s
from rallypoint.etcd.store import LeaseGrant

Scripted = int | Exception


class FakeLeaseStore:
    """Just the lease calls of a Store, answering from scripts.

    ``keepalive`` pops the next scripted answer (a TTL, or an exception to raise);
    each call can advance the fake clock by ``rtt_s`` to model a round trip.
    """

    def __init__(self, clock: FakeClock, *, granted_ttl: int = 6, rtt_s: float = 0.0) -> None:
        self.clock = clock
        self.granted_ttl = granted_ttl
        self.rtt_s = rtt_s
        self.keepalive_script: deque[Scripted] = deque()
        self.next_id = 0x100
        self.granted: list[LeaseGrant] = []
        self.keepalives: list[int] = []
        self.revoked: list[int] = []

    def script(self, answers: Iterable[Scripted]) -> None:
        self.keepalive_script.extend(answers)

    def grant_lease(self, ttl_s: int) -> LeaseGrant:
        self.clock.advance(self.rtt_s)
        grant = LeaseGrant(id=self.next_id, ttl_s=max(ttl_s, self.granted_ttl))
        self.next_id += 1
        self.granted.append(grant)
        return grant

    def keepalive(self, lease_id: int) -> int:
        self.keepalives.append(lease_id)
        self.clock.advance(self.rtt_s)
        answer = self.keepalive_script.popleft()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def revoke_lease(self, lease_id: int) -> None:
        self.revoked.append(lease_id)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=1000.0)


@pytest.fixture
def store(clock: FakeClock) -> FakeLeaseStore:
    return FakeLeaseStore(clock)


def _keeper(store: FakeLeaseStore, clock: FakeClock, **kw: object) -> LeaseKeeper:
    return LeaseKeeper(store, 6, who="worker w1", clock=clock, margin_s=1.0, **kw)  # type: ignore[arg-type]


# --- LocalFence ---------------------------------------------------------------------------


def test_fence_is_closed_until_armed(clock: FakeClock) -> None:
    fence = LocalFence("w", clock=clock, margin_s=1.0)
    assert not fence.valid() and not fence.dead
    with pytest.raises(Fenced, match="w is fenced"):
        fence.check()


def test_fence_deadline_is_sent_plus_ttl_minus_margin(clock: FakeClock) -> None:
    fence = LocalFence("w", clock=clock, margin_s=1.5)
    sent = clock.monotonic()
    clock.advance(0.5)  # the acknowledgement arrives later than the send
    fence.arm(sent, 10)
    assert fence.remaining_s() == pytest.approx(sent + 10 - 1.5 - clock.monotonic())
    clock.advance(7.75)  # sent + 8.25: before the deadline
    fence.check()
    assert fence.valid()
    clock.advance(0.25)  # sent + 8.5: exactly at the deadline (all values exact in binary)
    assert not fence.valid()
    with pytest.raises(Fenced) as info:
        fence.check()
    assert info.value.who == "w"
    assert "within the lease TTL" in info.value.reason
    assert not fence.dead  # expired locally, not dead


def test_fence_arm_never_moves_the_deadline_back(clock: FakeClock) -> None:
    fence = LocalFence("w", clock=clock, margin_s=1.0)
    now = clock.monotonic()
    fence.arm(now, 10)
    fence.arm(now - 5, 10)  # a late acknowledgement of an older keepalive
    fence.arm(now, 3)  # a shorter TTL from the same instant
    assert fence.remaining_s() == pytest.approx(9.0)
    fence.arm(now + 2, 10)
    assert fence.remaining_s() == pytest.approx(11.0)


def test_fence_kill_is_permanent(clock: FakeClock) -> None:
    fence = LocalFence("w", clock=clock, margin_s=1.0)
    fence.arm(clock.monotonic(), 10)
    fence.kill("lease revoked by the leader")
    assert fence.dead and not fence.valid()
    fence.arm(clock.monotonic(), 100)
    assert fence.dead and not fence.valid()
    with pytest.raises(Fenced, match="lease revoked by the leader"):
        fence.check()


def test_default_margin() -> None:
    assert default_margin_s(1) == pytest.approx(0.2)
    assert default_margin_s(10) == pytest.approx(1.5)


# --- LeaseKeeper -----------------------------------------------------------------------------


def test_keeper_rejects_ttl_below_one(store: FakeLeaseStore, clock: FakeClock) -> None:
    for ttl in (0, -3):
        with pytest.raises(ConfigError, match="lease TTL must be at least 1 s"):
            LeaseKeeper(store, ttl, who="w", clock=clock)


def test_keeper_default_margin_follows_ttl(store: FakeLeaseStore, clock: FakeClock) -> None:
    keeper = LeaseKeeper(store, 10, who="w", clock=clock)
    assert keeper.fence.margin_s == pytest.approx(default_margin_s(10))


def test_keeper_keeps_an_explicit_zero_margin(store: FakeLeaseStore, clock: FakeClock) -> None:
    keeper = LeaseKeeper(store, 10, who="w", clock=clock, margin_s=0.0)
    assert keeper.fence.margin_s == 0.0


def test_lease_id_before_acquire_is_an_error(store: FakeLeaseStore, clock: FakeClock) -> None:
    with pytest.raises(RuntimeError, match="not granted"):
        _ = _keeper(store, clock).lease_id


def test_acquire_arms_the_fence_from_the_send_time(clock: FakeClock) -> None:
    store = FakeLeaseStore(clock, granted_ttl=6, rtt_s=0.5)
    keeper = _keeper(store, clock)
    sent = clock.monotonic()
    grant = keeper.acquire()
    assert grant == store.granted[0] and keeper.lease_id == grant.id
    assert keeper.interval_s == pytest.approx(2.0)
    keeper.fence.check()
    assert keeper.fence.remaining_s() == pytest.approx(sent + 6 - 1.0 - clock.monotonic())


def test_step_success_extends_the_fence(store: FakeLeaseStore, clock: FakeClock) -> None:
    keeper = _keeper(store, clock)
    keeper.acquire()
    store.script([6])
    clock.advance(4.0)
    sent = clock.monotonic()
    assert keeper.step() is True
    assert store.keepalives == [keeper.lease_id]
    assert keeper.keepalives_sent == 1
    assert keeper.fence.remaining_s() == pytest.approx(sent + 5.0 - clock.monotonic())


def test_step_ttl_zero_kills_the_fence_and_reports_once(store: FakeLeaseStore, clock: FakeClock) -> None:
    lost: list[str] = []
    keeper = _keeper(store, clock, on_lost=lost.append)
    keeper.acquire()
    store.script([0])
    assert keeper.step() is False
    assert keeper.fence.dead
    assert len(lost) == 1 and "revoked" in lost[0]
    with pytest.raises(Fenced, match="expired or was revoked"):
        keeper.fence.check()


def test_step_store_unavailable_keeps_going_until_the_clock_fences(
    store: FakeLeaseStore, clock: FakeClock
) -> None:
    lost: list[str] = []
    keeper = _keeper(store, clock, on_lost=lost.append)
    keeper.acquire()  # deadline: now + 6 - 1
    store.script([StoreUnavailable("etcd down")] * 3)
    for _ in range(2):
        clock.advance(2.0)
        assert keeper.step() is True
        keeper.fence.check()  # still inside the lease
    clock.advance(1.0)  # 5 s after the grant: the deadline
    assert keeper.step() is True
    assert not keeper.fence.valid() and not keeper.fence.dead
    with pytest.raises(Fenced, match="no keepalive acknowledged"):
        keeper.fence.check()
    assert lost == []
    assert keeper.keepalives_sent == 0


def test_success_after_an_outage_recovers_the_same_lease(store: FakeLeaseStore, clock: FakeClock) -> None:
    lost: list[str] = []
    keeper = _keeper(store, clock, on_lost=lost.append)
    grant = keeper.acquire()
    fence = keeper.fence
    store.script([StoreUnavailable("etcd down"), StoreUnavailable("etcd down"), 6])
    clock.advance(3.0)
    keeper.step()
    clock.advance(3.0)
    keeper.step()
    assert not fence.valid()  # fenced by the clock alone
    sent = clock.monotonic()
    assert keeper.step() is True  # etcd answers again: the lease never expired
    assert keeper.fence is fence and keeper.lease_id == grant.id
    fence.check()
    assert fence.remaining_s() == pytest.approx(sent + 5.0 - clock.monotonic())
    assert len(store.granted) == 1 and lost == []


def test_acquire_after_the_fence_died_makes_a_fresh_fence(store: FakeLeaseStore, clock: FakeClock) -> None:
    keeper = _keeper(store, clock)
    first = keeper.acquire()
    old_fence = keeper.fence
    store.script([0])
    assert keeper.step() is False
    assert old_fence.dead
    second = keeper.acquire()
    assert second.id != first.id and keeper.lease_id == second.id
    assert keeper.fence is not old_fence
    keeper.fence.check()
    assert keeper.fence.who == old_fence.who and keeper.fence.margin_s == old_fence.margin_s
    assert old_fence.dead  # the old identity stays fenced


def test_stop_revokes_and_fences(store: FakeLeaseStore, clock: FakeClock) -> None:
    keeper = _keeper(store, clock)
    grant = keeper.acquire()
    keeper.stop()
    assert store.revoked == [grant.id]
    assert keeper.fence.dead


def test_stop_after_loss_does_not_revoke(store: FakeLeaseStore, clock: FakeClock) -> None:
    keeper = _keeper(store, clock)
    keeper.acquire()
    store.script([0])
    keeper.step()
    keeper.stop()
    assert store.revoked == []
