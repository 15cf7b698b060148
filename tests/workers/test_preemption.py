"""A preemption notice's logic against an in-memory store: ask for a drain, wait, give up at the deadline."""

from __future__ import annotations

import json
import threading
from typing import Any

from rallypoint.basics.clock import FakeClock
from rallypoint.etcd.drains import read_drain_requests
from rallypoint.etcd.keys import Keys
from rallypoint.workers.preemption import handle_preemption
from tests.fakes import MemoryStore

K = Keys("t")


class Log:
    def __init__(self) -> None:
        self.events: list[str] = []

    def _add(self, event: str, **_: Any) -> None:
        self.events.append(event)

    info = warning = error = _add


def holding(store: MemoryStore, lease: int) -> None:
    store.put(K.lease("w1", 0), json.dumps({"job": "j", "slice": "s"}), lease=lease)


def test_a_worker_holding_nothing_leaves_at_once_and_asks_for_nothing() -> None:
    store = MemoryStore()
    out = handle_preemption(store, K, "w1", lease_id=7, deadline_s=30, clock=FakeClock(), log=Log())
    assert out == "idle" and read_drain_requests(store, K) == {} and store.get(K.cordon("w1")) is None


def test_a_busy_worker_cordons_itself_and_requests_its_drain_on_its_own_lease_then_gives_up_at_the_deadline() -> None:
    store = MemoryStore()
    lease = store.grant_lease(2).id
    holding(store, lease)
    clock = FakeClock()
    log = Log()
    out = handle_preemption(store, K, "w1", lease_id=lease, deadline_s=3.0, clock=clock, log=log)
    assert out == "deadline" and "worker.preemption_deadline" in log.events
    (req,) = read_drain_requests(store, K).values()
    assert req.reason == "preempted" and req.deadline_s == 3.0
    assert store.get(K.drain("w1")).lease == lease and store.get(K.cordon("w1")).lease == lease
    assert json.loads(store.get(K.cordon("w1")).value)["by"] == "preemption"


def test_an_operators_cordon_is_kept_and_a_drained_worker_leaves_before_the_deadline() -> None:
    store = MemoryStore()
    lease = store.grant_lease(2).id
    holding(store, lease)
    store.put(K.cordon("w1"), json.dumps({"by": "operator"}))
    clock = FakeClock()

    class Draining(FakeClock):
        def sleep(self, seconds: float) -> None:  # the leader's drain frees the device meanwhile
            store.delete(K.lease("w1", 0))
            clock.sleep(seconds)

        def monotonic(self) -> float:
            return clock.monotonic()

    out = handle_preemption(store, K, "w1", lease_id=lease, deadline_s=30, clock=Draining(), log=Log())
    assert out == "drained"
    assert json.loads(store.get(K.cordon("w1")).value)["by"] == "operator" and store.get(K.cordon("w1")).lease == 0


def test_a_stop_while_waiting_ends_the_wait() -> None:
    store = MemoryStore()
    lease = store.grant_lease(2).id
    holding(store, lease)
    stop = threading.Event()
    stop.set()
    assert handle_preemption(store, K, "w1", lease_id=lease, deadline_s=30, clock=FakeClock(), log=Log(),
                             stop=stop) == "stopped"
