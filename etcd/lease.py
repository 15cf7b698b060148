"""Holding an etcd lease alive, and fencing on a local deadline.

A process that holds an identity through an etcd lease (a worker's incarnation, a
coordinator's leadership) must stop acting as soon as that lease *may* have
expired, without waiting to hear it from etcd: a partitioned or stopped process
hears nothing. :class:`LocalFence` keeps the deadline ``sent + TTL - margin``,
where ``sent`` is when the last acknowledged keepalive was *sent* (etcd refreshed
the lease after that instant, so the real expiry is later). Every action checks
the fence first.

When etcd elects a new leader it refreshes every lease, and a restart of etcd
keeps leases: a keepalive that succeeds after the fence tripped proves the lease
never expired and nobody could have taken the identity over, so the fence is
re-armed under the same identity. A keepalive answered with TTL 0 means the
lease is gone: the identity is dead for good and its owner must re-register.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from rallypoint.basics.clock import SYSTEM_CLOCK, Clock
from rallypoint.basics.errors import ConfigError, Fenced, StoreError
from rallypoint.basics.logs import get_logger
from rallypoint.etcd.store import LeaseGrant, Store


def default_margin_s(ttl_s: float) -> float:
    """Safety margin subtracted from the TTL for the local deadline."""
    return max(0.2, 0.15 * ttl_s)


class LocalFence:
    """A local monotonic deadline past which the holder must not act.

    Args:
        who: name used in :class:`~rallypoint.basics.errors.Fenced` messages.
        clock: monotonic clock (inject a fake one in tests).
        margin_s: how long before the lease's earliest possible expiry to stop.
    """

    def __init__(self, who: str, *, clock: Clock = SYSTEM_CLOCK, margin_s: float) -> None:
        self.who = who
        self.clock = clock
        self.margin_s = margin_s
        self._deadline = float("-inf")
        self._dead_reason: str | None = None
        self._lock = threading.Lock()

    def arm(self, sent_at: float, ttl_s: float) -> None:
        """Record a keepalive sent at ``sent_at`` (clock time) and acknowledged with ``ttl_s``."""
        with self._lock:
            if self._dead_reason is None:
                self._deadline = max(self._deadline, sent_at + ttl_s - self.margin_s)

    def kill(self, reason: str) -> None:
        """The lease is gone for good: fence forever."""
        with self._lock:
            self._dead_reason = reason
            self._deadline = float("-inf")

    @property
    def dead(self) -> bool:
        return self._dead_reason is not None

    def remaining_s(self) -> float:
        """Seconds until the deadline (negative once past)."""
        return self._deadline - self.clock.monotonic()

    def valid(self) -> bool:
        return self._dead_reason is None and self.clock.monotonic() < self._deadline

    def check(self) -> None:
        """Raise :class:`Fenced` unless the holder may still act."""
        if self._dead_reason is not None:
            raise Fenced(self.who, self._dead_reason)
        if self.clock.monotonic() >= self._deadline:
            raise Fenced(self.who, "no keepalive acknowledged within the lease TTL")


class LeaseKeeper:
    """Keeps one etcd lease alive from a background thread, with a :class:`LocalFence`.

    Args:
        store: the coordination store.
        ttl_s: requested TTL; etcd may grant more (its minimum).
        who: identity for logs and fence errors.
        on_lost: called once, from the keeper thread, when etcd says the lease is gone.
        clock: injectable clock.
        margin_s: fence margin; default :func:`default_margin_s`.
        log_fields: fields bound to every log event.
    """

    def __init__(
        self,
        store: Store,
        ttl_s: int,
        *,
        who: str,
        on_lost: Callable[[str], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        margin_s: float | None = None,
        log_fields: dict[str, Any] | None = None,
    ) -> None:
        if ttl_s < 1:
            raise ConfigError(f"lease TTL must be at least 1 s, got {ttl_s}; set --lease-ttl-s >= 1")
        self.store = store
        self.ttl_s = ttl_s
        self.clock = clock
        self.on_lost = on_lost
        self.fence = LocalFence(who, clock=clock, margin_s=default_margin_s(ttl_s) if margin_s is None else margin_s)
        self.grant: LeaseGrant | None = None
        self.keepalives_sent = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures = 0
        self.log = get_logger("rallypoint.lease", who=who, **(log_fields or {}))

    @property
    def lease_id(self) -> int:
        if self.grant is None:
            raise RuntimeError("lease not granted yet: call start() first")
        return self.grant.id

    @property
    def interval_s(self) -> float:
        ttl = self.grant.ttl_s if self.grant else self.ttl_s
        return ttl / 3.0

    def acquire(self) -> LeaseGrant:
        """Grant the lease and arm the fence, without starting the thread."""
        sent = self.clock.monotonic()
        self.grant = self.store.grant_lease(self.ttl_s)
        if self.fence.dead:
            self.fence = LocalFence(self.fence.who, clock=self.clock, margin_s=self.fence.margin_s)
        self.fence.arm(sent, self.grant.ttl_s)
        self.log.info("lease.granted", lease=f"{self.grant.id:x}", ttl_s=self.grant.ttl_s)
        return self.grant

    def start(self) -> LeaseGrant:
        """Grant the lease and keep it alive in a daemon thread."""
        grant = self.acquire()
        self.start_keepalive()
        return grant

    def start_keepalive(self) -> None:
        """Keep the acquired lease alive from a daemon thread."""
        self._thread = threading.Thread(target=self._run, name=f"keepalive-{self.lease_id:x}", daemon=True)
        self._thread.start()

    def step(self) -> bool:
        """One keepalive. Returns False once the lease is gone (the keeper is done)."""
        sent = self.clock.monotonic()
        try:
            ttl = self.store.keepalive(self.lease_id)
            self.keepalives_sent += 1
        except StoreError as exc:
            self._failures += 1
            if self._failures == 1 or self._failures % 10 == 0:
                self.log.warning(
                    "lease.keepalive_failed",
                    lease=f"{self.lease_id:x}",
                    failures=self._failures,
                    fence_remaining_s=round(self.fence.remaining_s(), 3),
                    error=str(exc),
                )
            return True
        if ttl <= 0:
            self.fence.kill("etcd lease expired or was revoked")
            self.log.warning("lease.lost", lease=f"{self.lease_id:x}")
            if self.on_lost is not None:
                self.on_lost("lease expired or revoked")
            return False
        was_valid = self.fence.valid()
        self.fence.arm(sent, ttl)
        if self._failures or not was_valid:
            self.log.info(
                "lease.recovered", lease=f"{self.lease_id:x}", failures=self._failures, was_fenced=not was_valid
            )
        self._failures = 0
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self.interval_s if self._failures == 0 else min(self.interval_s, 0.2)
            if self.clock.wait(self._stop, wait):
                return
            if not self.step():
                return

    def stop(self, *, revoke: bool = True) -> None:
        """Stop the keepalives; revoke the lease (deleting its keys) when ``revoke``."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if revoke and self.grant is not None and not self.fence.dead:
            try:
                self.store.revoke_lease(self.grant.id)
                self.log.info("lease.revoked", lease=f"{self.grant.id:x}", by="holder")
            except StoreError as exc:
                self.log.warning("lease.revoke_failed", lease=f"{self.grant.id:x}", error=str(exc))
        self.fence.kill("lease released")
