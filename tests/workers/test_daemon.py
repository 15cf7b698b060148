"""The worker daemon's registration and admission gate, against a MemoryStore (tests/fakes.py).

The whole daemon (gRPC server, data plane, real etcd, signals) is exercised by
tests/integration/test_liveness.py; these pin down the logic: an older incarnation is
waited for, then given up on with a clear message; requests from another incarnation
or an older coordinator term are refused.
"""

from __future__ import annotations

import threading

import pytest

from rallypoint.basics.errors import RallypointError
from rallypoint.etcd.keys import Keys
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.config import WorkerConfig
from rallypoint.workers.daemon import StaleIncarnation, StaleTerm, WorkerDaemon, WorkerState
from tests.fakes import MemoryStore, register_worker


def daemon(store: MemoryStore, *, timeout_s: float = 5.0) -> WorkerDaemon:
    cfg = WorkerConfig(cluster="t", worker_id="w1", endpoints=("127.0.0.1:1",), devices=2,
                       register_timeout_s=timeout_s, discover_devices=False)
    d = WorkerDaemon(cfg, store=store)
    d.devices = [{"index": i, "platform": "cpu", "kind": "cpu"} for i in range(2)]
    d.address = "127.0.0.1:7001"
    return d


def test_registers_itself_and_its_devices_on_its_own_lease() -> None:
    store, keys = MemoryStore(), Keys("t")
    d = daemon(store)
    try:
        d.register()
        kv = store.get(keys.worker("w1"))
        assert kv is not None and d.incarnation == kv.create_revision and d.state is WorkerState.SERVING
        devices = store.get_prefix(keys.worker_devices("w1"))[0]
        assert len(devices) == 2 and all(x.lease == kv.lease for x in devices)
    finally:
        d.registration.keeper.stop(revoke=True)  # type: ignore[union-attr]
    assert store.get(keys.worker("w1")) is None  # revoking the lease took the keys with it


def test_an_older_incarnation_is_waited_for_then_given_up_on_clearly() -> None:
    store, keys = MemoryStore(), Keys("t")
    old = register_worker(store, keys, "w1", 2)
    leases_before = set(store.leases)
    with pytest.raises(RallypointError, match=r"could not register within 0.5s: another incarnation still holds"):
        daemon(store, timeout_s=0.5).register()
    assert store.get(keys.worker("w1")).create_revision == old  # type: ignore[union-attr]
    assert set(store.leases) == leases_before  # the lease it took for itself is revoked


def test_registers_as_a_new_incarnation_once_the_older_one_expires() -> None:
    store, keys = MemoryStore(), Keys("t")
    old = register_worker(store, keys, "w1", 2)
    lease = store.get(keys.worker("w1")).lease  # type: ignore[union-attr]
    threading.Timer(0.4, store.revoke_lease, args=(lease,)).start()
    d = daemon(store, timeout_s=10.0)
    try:
        d.register()
        assert d.incarnation > old
    finally:
        d.registration.keeper.stop(revoke=True)  # type: ignore[union-attr]


def test_admission_refuses_another_incarnation_and_an_older_coordinator_term() -> None:
    store = MemoryStore()
    d = daemon(store)
    try:
        d.register()
        inc = d.incarnation
        assert d.admit(pb.Identity(worker_id="w1", incarnation=inc, term=7), leader=True).incarnation == inc
        with pytest.raises(StaleIncarnation):
            d.admit(pb.Identity(worker_id="w1", incarnation=inc + 1, term=7))
        with pytest.raises(StaleTerm):
            d.admit(pb.Identity(worker_id="w1", incarnation=inc, term=6), leader=True)  # a deposed leader
        with pytest.raises(StaleTerm):
            d.admit(pb.Identity(worker_id="w1", incarnation=inc, term=6))  # a peer's older term: checked too
        assert d.admit(pb.Identity(worker_id="w1", incarnation=inc, term=2**62)).incarnation == inc  # a peer's ...
        assert d.max_term == 7  # ... is never adopted: only the leader's moves the newest term
        assert d.admit(pb.Identity(worker_id="w1", incarnation=inc, term=9), leader=True).incarnation == inc
        assert d.max_term == 9
    finally:
        d.registration.keeper.stop(revoke=True)  # type: ignore[union-attr]
