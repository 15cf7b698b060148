"""A preemption notice (SIGTERM) on a worker: ask the leader to drain it, then leave.

Cloud and cluster schedulers announce a preemption with SIGTERM and a grace period
before the host goes. A worker that holds device leases then asks for a drain
(:mod:`rallypoint.etcd.drains`, reason ``preempted``, on its own etcd lease so the
request dies with it) and cordons itself (also on its lease, unless an operator's
cordon is there already), waits until it holds no device lease, and leaves. If its
deadline passes first, it leaves anyway: its registration and leases go, and the
ordinary loss path recovers its slices. A worker that holds nothing leaves at once.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from rallypoint.basics.clock import Clock
from rallypoint.etcd.drains import request_drain
from rallypoint.basics.errors import StoreError
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import Put, Store, key_missing

POLL_S = 0.1


def held_devices(store: Store, keys: Keys, worker: str) -> int:
    """How many of ``worker``'s devices some job holds."""
    kvs, _rev = store.get_prefix(keys.worker_leases(worker))
    return len(kvs)


def handle_preemption(store: Store, keys: Keys, worker: str, *, lease_id: int, deadline_s: float, clock: Clock,
                      log: Any, stop: threading.Event | None = None) -> str:
    """Drain this worker before ``deadline_s`` passes (or ``stop`` is set); returns ``"idle"``, ``"drained"``,
    ``"deadline"`` or ``"stopped"``."""
    t0 = clock.monotonic()
    try:
        if held_devices(store, keys, worker) == 0:
            log.info("worker.preempted", outcome="idle")
            return "idle"
        store.txn([key_missing(keys.cordon(worker))],
                  [Put(keys.cordon(worker), json.dumps({"by": "preemption", "at": time.time()}), lease=lease_id)])
        req = request_drain(store, keys, worker, reason="preempted", by=f"worker {worker}", deadline_s=deadline_s,
                            lease=lease_id)
    except StoreError as exc:  # etcd away: nobody can drain; the loss path will recover
        log.error("worker.preempted", outcome="etcd_unreachable", error=str(exc))
        return "deadline"
    log.warning("worker.preempted", deadline_s=deadline_s, request_revision=req.revision)
    while clock.monotonic() - t0 < deadline_s:
        if stop is not None and stop.is_set():
            log.warning("worker.preemption_stopped", waited_s=round(clock.monotonic() - t0, 3))
            return "stopped"
        try:
            if held_devices(store, keys, worker) == 0:
                log.info("worker.drained", waited_s=round(clock.monotonic() - t0, 3))
                return "drained"
        except StoreError:
            pass
        clock.sleep(max(0.0, min(POLL_S, deadline_s - (clock.monotonic() - t0))))
    log.warning("worker.preemption_deadline", deadline_s=deadline_s)
    return "deadline"
