"""The executor's straggler watch against fake workers whose events arrive late (a FakeClock moved per event).

A worker made slow has every one of its instances take ``SLOW_S`` of the fake clock
before it is heard; the others take ``FAST_S``. The watch must move the slow one's
slice to the spare by a drain (reason ``straggler``), leave its worker cordoned, and
say why with the numbers; a machine slow for everyone, no spare, or
``stragglers='off'`` move nothing.
"""

from __future__ import annotations

import heapq
import json
import queue
from pathlib import Path
from typing import Any

import pytest

from rallypoint.basics.clock import FakeClock
from rallypoint.orchestrator.job import stragglers
from rallypoint.orchestrator.job.state import JobState
from rallypoint.proto import rallypoint_pb2 as pb
from tests.fakes import FakeLog
from tests.helpers.executor import Harness, pipeline_spec

FAST_S, SLOW_S = 0.002, 0.08


class TimedEvents(queue.Queue):  # type: ignore[type-arg]
    """The workers' event queue as independent servers on the fake clock: a worker runs its instances one after
    another, each from when it was granted and its inputs were done, taking ``FAST_S`` (``SLOW_S`` on the slow
    worker; times ``everyone``); an event is heard when its instance is done, the clock moved there."""

    def __init__(self, h: Harness) -> None:
        self.h, self.slow, self.everyone, self.pause = h, "", 1.0, 0.0
        super().__init__()

    def _init(self, maxsize: int) -> None:
        self.queue: list[tuple[float, int, Any]] = []  # type: ignore[assignment]
        self.free_at: dict[str, float] = {}
        self.done: dict[tuple[str, int], float] = {}  # (node, step) -> when its instance is done
        self.n = 0

    def _qsize(self) -> int:
        return len(self.queue)

    def _put(self, item: Any) -> None:
        kind, (worker, _gen, ev) = item
        at = self.h.clock.monotonic()
        if kind == "done" and ev.node:
            cost = (SLOW_S if worker == self.slow else FAST_S) * self.everyone
            inputs = [self.done.get((p, ev.step - (how == "prev")), 0.0) for p, how in self.h.x.stragglers.deps[ev.node]]
            at = self.free_at[worker] = max(at, self.free_at.get(worker, at), *inputs) + cost
            self.done[(ev.node, ev.step)] = at
        self.n += 1
        heapq.heappush(self.queue, (at, self.n, item))

    def _get(self) -> Any:
        at, _, item = heapq.heappop(self.queue)
        self.h.clock.advance(max(0.0, at - self.h.clock.monotonic()))
        kind, (_worker, _gen, ev) = item
        if self.pause and kind == "done" and ev.node == "fwd0" and ev.step % 2 == 0:
            self.h.clock.advance(self.pause)  # the whole job stands still (etcd away): nothing is heard meanwhile
        return item


def harness(tmp_path: Path, workers: int = 3, **kw: Any) -> tuple[Harness, TimedEvents]:
    h = Harness(tmp_path, workers=workers, spec=pipeline_spec(steps=80, checkpoint_every=5, stall_timeout_s=600, **kw))
    q = TimedEvents(h)
    h.workers.events = q
    return h, q


def straggler_events(h: Harness) -> list[dict[str, Any]]:
    return [json.loads(e.detail) for e in h.events if e.event == "job.straggler"]


def test_a_slow_slice_moves_to_the_spare_by_a_drain_and_its_worker_stays_cordoned(tmp_path: Path) -> None:
    h, q = harness(tmp_path, workers=4)  # two spares: one to move to, one kept for recoveries
    h.x.begin()
    h.steps_until(20)
    assert h.x.stragglers.baseline and not straggler_events(h)  # measured, and nothing straggles yet
    slow = q.slow = h.worker_of("s1")
    h.steps_until(45)
    said = straggler_events(h)
    assert [d["decision"] for d in said][:2] == ["migrate", "migrated"], said
    migrate, migrated = said[0], said[1]
    assert migrate["slice"] == "s1" and migrate["worker"] == slow and migrate["slices"] == ["s1"]
    ev = migrate["evidence"]["slices"]
    assert ev["s1"]["slow_steps"] >= 4 and ev["s0"]["slow_steps"] == 0
    assert min(ev["s1"]["step_slowdown"][-4:]) >= 2.0 and ev["s1"]["own_s"][-1] >= (SLOW_S - 0.01) * 0.9  # less its 10 ms of compute_s
    assert ev["s1"]["straggles"] and ev["s1"]["slowdown"] >= 2 * ev["s1"]["peers_slowdown"] and not ev["s0"]["straggles"]
    assert 0 < migrate["detection_s"] < 2.0  # the slowness began at most a few steps before the decision
    (drain,) = h.x.drains.drain_records
    assert drain.reason == "straggler" and drain.state == "done" and drain.moved["s1"] not in (slow, h.worker_of("s0"))
    assert h.worker_of("s1") == drain.moved["s1"] and migrated["moved"] == drain.moved
    cordon = h.store.get(h.keys.cordon(slow))
    assert cordon is not None and cordon.json()["by"] == "straggler" and cordon.json()["slice"] == "s1"
    assert not h.x.progress.replayed  # a drain replays nothing
    h.steps_until(80)
    detail = json.loads(h.x.finish().detail)
    assert [d["decision"] for d in detail["stragglers"]][:2] == ["migrate", "migrated"]
    assert detail["drains"][0]["reason"] == "straggler" and detail["drains"][0]["replayed_instances"] == 0


def test_slow_for_everyone_alike_is_no_straggler(tmp_path: Path) -> None:
    h, q = harness(tmp_path)
    h.x.begin()
    h.steps_until(20)
    q.everyone = 40.0
    h.steps_until(60)
    assert straggler_events(h) == [] and h.x.drains.drain_records == []


@pytest.mark.parametrize("workers, why", [(2, "no live, uncordoned worker"), (3, "is kept for recoveries")])
def test_no_spare_is_said_once_a_window_and_nothing_is_cordoned(tmp_path: Path, workers: int, why: str) -> None:
    h, q = harness(tmp_path, workers=workers)
    h.x.begin()
    h.steps_until(20)
    slow = q.slow = h.worker_of("s0")
    h.steps_until(60)
    said = straggler_events(h)
    assert said and {d["decision"] for d in said} == {"no_spare"}, said
    assert why in said[0]["reason"] and said[0]["evidence"]["straggler"] == "s0"
    assert len(said) <= (60 - 20) // 8 + 1
    assert h.x.drains.drain_records == [] and h.store.get(h.keys.cordon(slow)) is None and h.x.state is JobState.RUNNING


def test_report_mode_moves_nothing_and_off_measures_nothing(tmp_path: Path) -> None:
    h, q = harness(tmp_path / "r", stragglers="report")
    h.x.begin()
    h.steps_until(20)
    q.slow = h.worker_of("s1")
    h.steps_until(40)
    said = straggler_events(h)
    assert said and {d["decision"] for d in said} == {"keep"} and "only reported" in said[0]["reason"]
    assert h.x.drains.drain_records == []
    h2, q2 = harness(tmp_path / "o", stragglers="off")
    h2.x.begin()
    q2.slow = h2.worker_of("s1")
    h2.steps_until(40)
    assert straggler_events(h2) == [] and h2.x.stragglers.baseline == {} and h2.x.drains.drain_records == []


@pytest.mark.parametrize("pause_s, moved", [(stragglers.PAUSE_S * 2, False), (stragglers.PAUSE_S / 2, True)])
def test_the_whole_job_standing_still_is_nobodys_own_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        pause_s: float, moved: bool) -> None:
    # Every other step the job stands still before s0's instance is heard (as while etcd is away, with s0's
    # instance ready since its grant). A pause past PAUSE_S resets the window; shorter ones are s0's own time.
    h, q = harness(tmp_path, workers=4)
    h.x.begin()
    h.steps_until(20)
    q.pause = pause_s
    h.steps_until(60)
    said = straggler_events(h)
    assert ([d["decision"] for d in said][:1] == ["migrate"]) is moved, said
    assert (len(h.x.drains.drain_records) == 1) is moved


def with_a_source(tmp_path: Path, checkpoint_every: int) -> tuple[Harness, stragglers.StragglerWatch, float]:
    """The two-stage pipeline with a source ``src`` (no inputs) on s0, begun: its harness, watch and clock now."""
    spec = pipeline_spec(steps=20, checkpoint_every=checkpoint_every, stall_timeout_s=600)
    spec.nodes.append(pb.NodeProgram(name="src", slice="s0", every=1))
    h = Harness(tmp_path, spec=spec)
    h.x.begin()
    return h, h.x.stragglers, h.clock.monotonic()


def test_a_source_waiting_at_its_slices_checkpoint_is_charged_only_from_the_saves_end(tmp_path: Path) -> None:
    # A source (no inputs) is granted ahead, but the worker runs it at a checkpoint step only once its slice saved,
    # after the slice's last instance of the step before, which in a pipeline waits for every later stage. That
    # wait is not the source slice's own time, nor is the save (work, which its worker reports as saving_s).
    h, w, t0 = with_a_source(tmp_path, checkpoint_every=5)
    w.granted_at.update({4: t0, 5: t0, 6: t0})

    def heard(node: str, step: int, after_s: float, saving_s: float = 0.0) -> None:
        h.clock.advance(after_s)
        w.instance(pb.InstanceDone(node=node, step=step, compute_s=0.0, saving_s=saving_s))

    heard("src", 4, 0.001)
    heard("fwd0", 4, 0.3)  # the slice's step 4 is all heard: it saves step 5 (15 ms), then runs step 5
    heard("src", 5, 0.02, saving_s=0.015)
    assert w._own(5, "s0") == pytest.approx(0.005)  # not the 0.32 s since its grant, nor the save
    heard("src", 6, 0.01)
    assert w._own(6, "s0") == pytest.approx(0.015)  # granted with step 5, it waited behind the same save
    w.granted_at[7] = h.clock.monotonic()
    heard("src", 7, 0.04)
    assert w._own(7, "s0") == pytest.approx(0.04)  # past the save, a source waits for nothing: all of it is its own


def test_the_loops_work_on_the_step_before_is_not_a_waiting_sources_own_time(tmp_path: Path) -> None:
    # The source of step 2, granted with step 1, waits while the slice's loop runs fwd0 of step 1 (40 ms of compute,
    # 5 ms of bookkeeping): that is work, though of another step; what is left of the wait is the source's own.
    h, w, t0 = with_a_source(tmp_path, checkpoint_every=10)
    w.granted_at.update({1: t0, 2: t0})
    h.clock.advance(0.05)
    w.instance(pb.InstanceDone(node="fwd0", step=1, compute_s=0.04, busy_s=0.005))
    h.clock.advance(0.01)
    w.instance(pb.InstanceDone(node="src", step=2, compute_s=0.004, busy_s=0.001))
    assert w._own(2, "s0") == pytest.approx(0.06 - 0.045 - 0.005)


class FakeProgress:
    def __init__(self) -> None:
        self.completed = self.granted = self.start = 0


class FakePort:
    """A scripted StragglerPort: s0 on w0, s1 on w1, spares w2 and w3 registered in a MemoryStore (``gang``: s1 is
    a gang of w1 and w2, spares w3 to w3 + ``gang``); it records the cordons and drains the watch asks for (no
    executor)."""

    def __init__(self, gang: int = 0) -> None:
        from rallypoint.etcd.cluster_view import read_cluster
        from rallypoint.etcd.keys import Keys
        from rallypoint.recovery.load_plan import SlicePlace
        from tests.fakes import MemoryStore, register_worker
        self.progress = FakeProgress()
        self.store, self.keys = MemoryStore(), Keys("t")
        for i in range(4 + gang):
            register_worker(self.store, self.keys, f"w{i}", 1)
        self._read = lambda: read_cluster(self.store, self.keys)
        self.places = {"s0": SlicePlace("w0", "w0:1", 1, (0,)), "s1": SlicePlace("w1", "w1:1", 2, (0,))}
        if gang:
            members = (SlicePlace("w1", "w1:1", 2, (0,)), SlicePlace("w2", "w2:1", 3, (0,)))
            self.places["s1"] = SlicePlace("w1", "w1:1", 2, (0,), members=members)
        self.said: list[tuple[str, dict[str, Any]]] = []
        self.cordoned: list[str] = []
        self.probations: list[Any] = []
        self.moves: dict[str, list[float]] = {}
        self.drained: list[str] = []
        self.busy_reason = ""

    def busy(self) -> str:
        return self.busy_reason

    def placement(self) -> Any:
        return self.places

    def loaded_workers(self) -> list[str]:
        return sorted({m.worker for p in self.places.values() for m in (p, *p.members)})

    def cluster(self) -> Any:
        return self._read()

    def cordon(self, worker: str, slice_name: str, probation: Any) -> str:
        self.cordoned.append(worker)
        self.probations.append(probation)
        return ""

    def straggler_moves(self, worker: str) -> list[float]:
        return list(self.moves.get(worker, []))

    def note_moves(self, worker: str, moves: tuple[float, ...]) -> None:
        self.moves[worker] = list(moves)

    def uncordon(self, worker: str) -> None:
        self.cordoned.remove(worker)

    def drain(self, worker: str) -> Any:
        from rallypoint.orchestrator.job.drain import DrainRecord
        self.drained.append(worker)
        self.busy_reason = f"drain 1 of worker {worker} (straggler) runs"
        return DrainRecord(1, worker, "straggler", 0, 0.0)

    def event(self, event: str, step: int = 0, **detail: Any) -> None:
        self.said.append((event, detail))


def drive(watch: stragglers.StragglerWatch, port: FakePort, clock: Any, steps: range, slow: dict[str, float]) -> None:
    """Each step granted, then fwd0 (s0) and fwd1 (s1) heard in turn, each taking 2 ms plus its slice's stall."""
    for s in steps:
        port.progress.granted = s + 1
        watch.advanced()
        for node, sl in (("fwd0", "s0"), ("fwd1", "s1")):
            clock.advance(0.002 + slow.get(sl, 0.0))
            watch.instance(pb.InstanceDone(node=node, step=s, compute_s=0.001))
        port.progress.completed = s + 1
        watch.advanced()


def test_the_watch_judges_through_its_port_alone_and_moves_a_stalled_slice() -> None:
    from rallypoint.basics.clock import FakeClock
    from rallypoint.recovery.stragglers import StragglerSettings
    clock, port, log = FakeClock(), FakePort(), FakeLog()
    watch = stragglers.StragglerWatch(pipeline_spec(steps=120), port, clock=clock, log=log)
    watch.configure(StragglerSettings(), checkpoint_every=0)
    drive(watch, port, clock, range(0, 20), {})
    assert watch.baseline and port.said == []
    port.busy_reason = "recovery 1 runs"  # nothing is judged while the job is disturbed
    drive(watch, port, clock, range(20, 40), {"s1": 0.08})
    assert port.drained == [] and port.said == []
    port.busy_reason = ""
    drive(watch, port, clock, range(40, 70), {"s1": 0.08})
    assert port.drained == []  # a window of undisturbed steps passes before samples count again
    drive(watch, port, clock, range(70, 100), {"s1": 0.08})
    decisions = [d["decision"] for e, d in port.said if e == "job.straggler"]
    assert decisions == ["migrate"] and port.drained == ["w1"] and port.cordoned == ["w1"], port.said
    assert port.said[0][1]["slice"] == "s1" and port.said[0][1]["first_slow_step"] >= 56


WALL_START = 1_000_000_000.0  # the fake clock's wall time: far from the real one, so a real read shows


def moved_once(ago: list[float], *, pause_s: float = 0.0) -> tuple[FakePort, list[str], FakeClock]:
    """Drive the scripted port until its straggler's drain is done; the decisions said. ``ago``: the worker's
    earlier straggler moves, seconds before the job started on the fake clock; ``pause_s``: how far that clock
    moves before the job runs (no real time passes)."""
    from rallypoint.recovery.stragglers import StragglerSettings
    clock, port = FakeClock(wall_start=WALL_START), FakePort()
    port.moves["w1"] = [WALL_START - a for a in ago]
    clock.advance(pause_s)
    watch = stragglers.StragglerWatch(pipeline_spec(steps=120), port, clock=clock, log=FakeLog())
    watch.configure(StragglerSettings(probation_s=30.0, repeat_window_s=600.0), checkpoint_every=0)
    drive(watch, port, clock, range(0, 20), {})
    drive(watch, port, clock, range(20, 60), {"s1": 0.08})
    assert port.drained == ["w1"], port.said
    watch.pending["drain"].state = "done"  # the drain moved s1 to w2
    watch.pending["drain"].moved = {"s1": "w2"}
    watch.advanced()
    return port, [d["decision"] for e, d in port.said if e == "job.straggler"], clock


def test_a_straggler_s_worker_is_cordoned_on_probation_and_its_move_is_recorded() -> None:
    port, decisions, _ = moved_once([3600])  # a move an hour ago is outside the window
    assert decisions == ["migrate", "migrated"]
    (probation,) = port.probations
    assert probation.lapse_s == 30.0 and len(probation.moves) == 1
    assert port.moves["w1"] == list(probation.moves)  # recorded once the drain is done
    assert "on probation" in port.said[1][1]["reason"] and port.said[1][1]["probation_s"] == 30.0


def test_a_worker_moved_off_twice_in_the_window_stays_out_and_is_reported() -> None:
    port, decisions, _ = moved_once([60])
    assert decisions == ["migrate", "migrated", "kept_out"]
    (probation,) = port.probations
    assert probation.lapse_s is None and len(probation.moves) == 2 and len(port.moves["w1"]) == 2
    kept = port.said[2][1]
    assert kept["worker"] == "w1" and "2 times within 600 s" in kept["reason"] and "uncordon" in kept["reason"]


def test_the_repeat_window_ends_when_the_job_s_clock_moves_past_it_with_no_real_wait() -> None:
    """The probation is judged on the injected clock's wall time: a move 60 s before keeps the worker out; the
    same move once the fake clock has moved on past the 600 s window is history, and the worker is on probation
    again. The move and the decisions are stamped with the fake clock's time, not the real one."""
    _, kept_out, _ = moved_once([60])
    assert kept_out == ["migrate", "migrated", "kept_out"]
    port, decisions, clock = moved_once([60], pause_s=600.0)
    assert decisions == ["migrate", "migrated"]
    (probation,) = port.probations
    assert probation.lapse_s == 30.0 and len(probation.moves) == 1
    assert WALL_START + 600.0 < probation.moves[0] <= clock.wall() < WALL_START + 700.0
    assert all(WALL_START < d["at"] <= clock.wall() for e, d in port.said if e == "job.straggler")


@pytest.mark.parametrize(("spares", "moved"), [(3, True), (2, False)])
def test_a_slow_gang_moves_whole_by_a_drain_of_its_lead_when_a_whole_gang_has_room_beside_one_kept(
        spares: int, moved: bool) -> None:
    """A gang (s1 on w1 and w2, one device each) is slow: its lead's worker is drained (the drain moves the gang
    whole, docs/multihost.md) when spares for a whole new gang and one more are free; with room for the gang alone
    it is kept, said why. (Before, the room was looked for on one worker, which never has a gang's devices.)"""
    from rallypoint.basics.clock import FakeClock
    from rallypoint.recovery.stragglers import StragglerSettings
    clock, port = FakeClock(), FakePort(gang=spares - 1)
    watch = stragglers.StragglerWatch(pipeline_spec(steps=120), port, clock=clock, log=FakeLog())
    watch.configure(StragglerSettings(), checkpoint_every=0)
    drive(watch, port, clock, range(0, 20), {})
    drive(watch, port, clock, range(20, 60), {"s1": 0.08})
    decisions = [(d["decision"], d.get("reason", "")) for e, d in port.said if e == "job.straggler"]
    if moved:
        assert decisions[0][0] == "migrate" and port.drained == ["w1"] and port.cordoned == ["w1"], decisions
    else:
        assert port.drained == [] and decisions[0][0] == "no_spare", decisions
        assert "only 2 workers (w3, w4) have room for a member of slice s1 (2 members of 1 devices)" in decisions[0][1]
