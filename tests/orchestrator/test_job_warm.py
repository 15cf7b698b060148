"""The executor's warm spares (orchestrator/job/warm.py) over fake clusters and a fake worker stub."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import pytest
import structlog

from rallypoint.orchestrator.job.warm import WARM_CHECK_S, SpareWarmer
from rallypoint.proto import rallypoint_pb2 as pb
from tests.helpers.snapshots import cluster, worker


class FakeWorkers:
    """Records WarmJob requests; answers them when told to."""

    def __init__(self) -> None:
        self.events: queue.Queue[Any] = queue.Queue()
        self.sent: list[tuple[str, str, pb.WarmJobRequest]] = []
        self._done: dict[str, Callable[[str, pb.WarmJobResponse | None, str], None]] = {}
        self.now: list[str] = []

    def warm(self, worker: str, address: str, req: pb.WarmJobRequest, done: Callable[..., None]) -> None:
        self.sent.append((worker, address, req))
        self._done[worker] = done

    def answer(self, worker: str, resp: pb.WarmJobResponse | None = None, error: str = "") -> None:
        self._done.pop(worker)(worker, resp, error)

    def warm_now(self, worker: str, address: str, req: pb.WarmJobRequest, *, timeout_s: float) -> pb.WarmJobResponse:
        assert not req.slices and not req.nodes
        self.now.append(worker)
        return pb.WarmJobResponse()


def spec() -> pb.JobSpec:
    s = pb.JobSpec(job="j")
    for name, shape in (("big", [2]), ("small", [1])):
        s.slices.append(pb.SliceAssignment(slice=name, mesh_shape=shape, mesh_axes=["d"]))
    for name, sl in (("fb", "big"), ("ub", "big"), ("fs", "small")):
        s.nodes.append(pb.NodeProgram(name=name, slice=sl, exported=name.encode(),
                                      variants=[pb.ExportedVariant(devices=1, exported=b"v")]))
    return s


def warmer(max_spares: int = 2) -> tuple[SpareWarmer, FakeWorkers]:
    fake = FakeWorkers()
    return SpareWarmer(spec(), fake, cluster="c", term=7, max_spares=max_spares,  # type: ignore[arg-type]
                       log=structlog.get_logger("test")), fake


def test_a_spare_gets_the_programs_of_its_slices_for_the_devices_a_remap_would_lease() -> None:
    w, fake = warmer(max_spares=1)
    snap = cluster(worker("busy", 4, held=[0]), worker("s1", 4, held=[]), worker("s2", 3))
    assert w.refresh(snap, "placed")
    ((name, address, req),) = fake.sent
    assert (name, address) == ("s2", "s2:1")  # the tightest spare with room for both, as a remap would take it
    assert req.to == pb.Identity(cluster="c", worker_id="s2", incarnation=100, term=7) and req.job == "j"
    assert [(sa.slice, list(sa.devices), list(sa.mesh_shape)) for sa in req.slices] == [("big", [0, 1], [2]),
                                                                                       ("small", [0], [1])]
    assert [n.name for n in req.nodes] == ["fb", "ub", "fs"] and not any(n.variants for n in req.nodes)
    assert w.plan == {"s2": ["big", "small"]}


def test_nothing_changed_sends_nothing_and_a_round_ends_in_one_warmed_event() -> None:
    w, fake = warmer()
    snap = cluster(worker("a", 2), worker("b", 2))
    assert w.refresh(snap, "placed")
    assert not w.refresh(snap, "the spares changed")
    assert len(fake.sent) == 2 and fake.events.empty()
    fake.answer("a", pb.WarmJobResponse(compile_s={"fb": 0.5, "fs": 0.25}))
    assert fake.events.empty()  # the round waits for every spare
    fake.answer("b", None, "UNAVAILABLE gone")
    kind, (_, _, detail) = fake.events.get_nowait()
    assert kind == "warmed" and detail["round"] == 1 and detail["reason"] == "placed"
    assert detail["plan"] == {"a": ["big", "small"], "b": ["big", "small"]}
    assert detail["compile_s"] == {"a": 0.75} and detail["failed"] == {"b": "UNAVAILABLE gone"}


def test_a_spare_taken_drops_its_part_and_the_next_spare_is_warmed() -> None:
    w, fake = warmer(max_spares=1)
    w.refresh(cluster(worker("a", 2), worker("b", 2)), "placed")
    assert [s for s, _, _ in fake.sent] == ["a"]
    fake.sent.clear()
    assert w.refresh(cluster(worker("a", 2, held=[0, 1]), worker("b", 2)), "recovery 1")
    sent = {s: r for s, _, r in fake.sent}
    assert set(sent) == {"a", "b"} and not sent["a"].slices and not sent["a"].nodes
    assert [sa.slice for sa in sent["b"].slices] == ["big", "small"]
    assert w.plan == {"b": ["big", "small"]}


def test_a_spare_that_registered_again_is_asked_again() -> None:
    w, fake = warmer(max_spares=1)
    w.refresh(cluster(worker("a", 2)), "placed")
    assert w.refresh(cluster(worker("a", 2, incarnation=101)), "the spares changed")
    assert [r.to.incarnation for _, _, r in fake.sent] == [100, 101]


def test_off_sends_nothing() -> None:
    w, fake = warmer(max_spares=0)
    assert not w.refresh(cluster(worker("a", 2)), "placed") and not fake.sent and w.plan == {}


def test_cordoned_leaving_or_excluded_workers_warm_nothing() -> None:
    w, fake = warmer()
    snap = cluster(worker("c", 2, cordoned=True), worker("l", 2, state="leaving"), worker("x", 2))
    assert not w.refresh(snap, "placed", exclude=frozenset({"x"})) and not fake.sent


def test_release_drops_every_held_part_of_the_live_incarnations() -> None:
    w, fake = warmer()
    w.refresh(cluster(worker("a", 2), worker("b", 2)), "placed")
    w.release({"a": 100, "b": 555})
    assert fake.now == ["a"] and w.plan == {}
    w.release()
    assert fake.now == ["a"]


def test_a_negative_budget_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="warm_spares"):
        warmer(max_spares=-1)


def test_the_plan_is_made_again_a_step_after_it_was_asked_for_and_every_few_seconds_outside_recoveries() -> None:
    w, _ = warmer()
    assert w.due(0.0, 0, False) == "the spares changed"  # never planned: now
    assert w.due(1.0, 0, False) is None  # planned a second ago
    w.soon("placed", 3)
    assert w.due(1.0, 3, False) is None  # the job's own step comes first
    assert w.due(1.0, 4, True) == "placed"  # asked for: even while a recovery runs
    assert w.due(1.0 + WARM_CHECK_S, 9, True) is None  # the periodic check waits for the recovery
    assert w.due(1.0 + WARM_CHECK_S - 0.01, 9, False) is None
    assert w.due(1.0 + WARM_CHECK_S, 9, False) == "the spares changed"


def test_a_gang_keeps_a_member_started_on_each_of_its_workers_and_on_the_spares_a_new_gang_would_take() -> None:
    """No one spare compiles a multi-host slice's programs: every worker a new gang would be formed on (its own
    members' workers, the spares ``choose_gang`` takes, within the budget) keeps a member process started."""
    fake = FakeWorkers()
    w = SpareWarmer(spec(), fake, cluster="c", term=7, max_spares=2,  # type: ignore[arg-type]
                    log=structlog.get_logger("test"), gangs=lambda: {"big": ["g0", "g1"]})
    snap = cluster(worker("g0", 1, held=[0]), worker("g1", 1, held=[0]), worker("s1", 1), worker("s2", 1),
                   worker("s3", 1))
    assert w.refresh(snap, "placed", exclude=frozenset({"g0", "g1"}))
    asked = {name: (req.members, [sa.slice for sa in req.slices]) for name, _, req in fake.sent}
    # "small" (1 device) is warmed as usual, on both spares of the budget; "big" is the gang: a member on each of
    # its workers and on the spares of a new gang of two, s3 left out of the budget of 2 spares
    assert asked == {"g0": (1, []), "g1": (1, []), "s1": (1, ["small"]), "s2": (1, ["small"])}, asked
    for name in list(fake._done):
        fake.answer(name, pb.WarmJobResponse())
    w.release()
    assert sorted(fake.now) == ["g0", "g1", "s1", "s2"]  # the job's end ends them all
