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


def test_corrupt_faults_parse_and_are_armed_for_the_slices_worker_before_their_step(tmp_path: Any) -> None:
    """`--fail corrupt:NAME@STEP` (persist) and `corrupt-once:`: the specs are written before the job runs (any
    worker holding the slice), then again naming the worker that holds it once the job is placed (and the node,
    when NAME is one); again for a slice that moved before its step, not after it; no etcd is touched."""
    from rallypoint.basics.errors import ConfigError
    from rallypoint.client.commands.faults import parse_faults
    from rallypoint.workers.corruption import CorruptSpec, read_specs

    faults = parse_faults(["corrupt:s1@3", "corrupt-once:upd2@5"], slices=["s1", "s2"],
                          node_slices={"upd2": "s2"}, steps=10)
    assert faults == [Fault("s1", "s1", 3, "corrupt"), Fault("upd2", "s2", 5, "corrupt-once")]
    try:
        parse_faults(["rot:s1@3"], slices=["s1"], node_slices={}, steps=10)
        raise AssertionError("an unknown action is refused")
    except ConfigError as exc:
        assert "corrupt, corrupt-once" in str(exc)
    flag = tmp_path / "corrupt.json"

    def refuse(_endpoints: Any) -> Any:
        raise AssertionError("a corrupt fault needs no etcd")

    inj = FaultInjector(faults, ["127.0.0.1:1"], "t", connect=refuse, corrupt_flag=str(flag))
    assert read_specs(flag) == [CorruptSpec("s1", 3, "persist"), CorruptSpec("s2", 5, "once", node="upd2")]
    assert inj.fired == []
    inj.on_event(pb.JobEvent(event="job.placed", detail='{"s1": {"worker": "w1"}, "s2": {"worker": "w2"}}'))
    assert read_specs(flag) == [CorruptSpec("s1", 3, "persist", worker="w1"),
                                CorruptSpec("s2", 5, "once", worker="w2", node="upd2")]
    assert [(f["fault"], f["worker"], f.get("armed")) for f in inj.fired] == [
        ("corrupt:s1@3", "w1", True), ("corrupt-once:upd2@5", "w2", True)]
    inj.on_event(pb.JobEvent(event="step.done", step=3))  # steps 0..3 done: s1's step reached, s2's not
    inj.on_event(pb.JobEvent(event="job.recovered", detail='{"placement": {"s1": {"worker": "w3"}, '
                                                           '"s2": {"worker": "w4"}}}'))
    assert read_specs(flag) == [CorruptSpec("s1", 3, "persist", worker="w1"),
                                CorruptSpec("s2", 5, "once", worker="w4", node="upd2")]
    assert len(inj.fired) == 3 and inj.fired[-1]["worker"] == "w4"


def test_a_corrupt_fault_without_a_flag_file_is_reported_not_fired() -> None:
    inj = FaultInjector([Fault("s1", "s1", 3, "corrupt")], ["127.0.0.1:1"], "t")
    inj.on_event(pb.JobEvent(event="job.placed", detail='{"s1": {"worker": "w1"}}'))
    (fired,) = inj.fired
    assert "without a corrupt flag" in fired["error"] and "armed" not in fired
