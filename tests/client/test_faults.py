"""The fault injector of ``--fail`` against an etcd whose first calls fail, as a fresh connection's can on a loaded
host (its TLS handshake cut short): the fault still fires."""

from __future__ import annotations

from typing import Any

from rallypoint.basics.errors import StoreUnavailable
from rallypoint.client.commands.faults import Fault, FaultInjector
from rallypoint.etcd.keys import Keys
from rallypoint.proto import rallypoint_pb2 as pb
from tests.fakes import MemoryStore, register_worker


class FlakyStore(MemoryStore):
    """A store whose first ``failures`` calls raise as an unreachable etcd does."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def _flake(self) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise StoreUnavailable("etcd unreachable (UNAVAILABLE: Handshake read failed)")

    def txn(self, *args: Any, **kwargs: Any) -> Any:
        self._flake()
        return super().txn(*args, **kwargs)

    def get(self, key: str) -> Any:
        self._flake()
        return super().get(key)

    def close(self) -> None:
        pass


def injector(store: FlakyStore, action: str) -> FaultInjector:
    inj = FaultInjector([Fault("s1", "s1", 3, action)], ["127.0.0.1:1"], "t",
                        connect=lambda _endpoints: store)  # type: ignore[arg-type, return-value]
    inj.on_event(pb.JobEvent(event="job.placed", detail='{"s1": {"worker": "w1"}}'))
    return inj


def test_a_drain_fault_fires_through_an_etcd_that_fails_its_first_calls() -> None:
    store = FlakyStore(failures=0)
    register_worker(store, Keys("t"), "w1", 1)
    store.failures = 2
    inj = injector(store, "drain")
    inj.on_event(pb.JobEvent(event="step.done", step=2))
    (fired,) = inj.fired
    assert "error" not in fired and fired["drain_revision"] > 0, fired
    assert store.get(Keys("t").drain("w1")) is not None and store.get(Keys("t").cordon("w1")) is not None


def test_a_kill_fault_reads_the_worker_through_an_etcd_that_fails_its_first_call() -> None:
    store = FlakyStore(failures=0)
    register_worker(store, Keys("t"), "w1", 1)  # no pid or host recorded: the injector says so, having read it
    store.failures = 1
    inj = injector(store, "kill")
    inj.on_event(pb.JobEvent(event="step.done", step=2))
    (fired,) = inj.fired
    assert "not this host" in fired["error"], fired
