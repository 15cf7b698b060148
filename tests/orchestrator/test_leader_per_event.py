"""The leader's work per event does not grow with the job's slices (bench/leader_scale.py measures it), and gives
the answers it gave when it scanned: JobProgress's completion and cut, the StragglerWatch's marks, on randomized
event sequences against the scanning versions kept here as references. Pure logic, no executor."""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from rallypoint.basics.clock import FakeClock
from rallypoint.basics.errors import StoreError
from rallypoint.etcd.keys import Keys
from rallypoint.orchestrator.job import progress as progress_module
from rallypoint.orchestrator.job.progress import JobProgress
from rallypoint.orchestrator.job.straggler_marks import NEVER, Marks
from rallypoint.orchestrator.job.stragglers import StragglerWatch
from rallypoint.orchestrator.job.term import JobTerm
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.load_plan import instances_per_step
from rallypoint.recovery.replay import Graph
from rallypoint.recovery.stragglers import StragglerSettings
from tests.fakes import FakeElection, FakeLog, MemoryStore, register_worker
from tests.helpers.executor import eval_spec

B = pb.InputBinding


def chain(slices: int, steps: int = 40, checkpoint_every: int = 4, stateless: int = 1) -> pb.JobSpec:
    """``slices`` stages (one node and state each, each reading the one before, the second per microbatch), and
    ``stateless`` slices without states (a node every 3 steps reading the last stage's state)."""
    nodes, states = [], []
    for i in range(slices):
        inputs = [B(arg="p", kind=B.STATE, state=f"p{i}")] + ([B(arg="x", kind=B.REF, node=f"f{i - 1}", output="y")]
                                                              if i else [])
        nodes.append(pb.NodeProgram(name=f"f{i}", slice=f"s{i}", every=1, inputs=inputs, per_microbatch=i == 1))
        states.append(pb.StateProgram(name=f"p{i}", slice=f"s{i}", producer_node=f"f{i}", producer_every=1))
    for j in range(stateless):
        nodes.append(pb.NodeProgram(name=f"e{j}", slice=f"ev{j}", every=3,
                                    inputs=[B(arg="p", kind=B.STATE, state=f"p{slices - 1}")]))
    return pb.JobSpec(job="j", steps=steps, microbatches=2, window=2, checkpoint_every=checkpoint_every,
                      slices=[pb.SliceAssignment(slice=f"s{i}", mesh_shape=[1]) for i in range(slices)]
                      + [pb.SliceAssignment(slice=f"ev{j}", mesh_shape=[1]) for j in range(stateless)],
                      nodes=nodes, states=states)


def instances(spec: pb.JobSpec, step: int) -> list[pb.InstanceDone]:
    return [pb.InstanceDone(node=n.name, step=step, microbatch=mb, compute_s=0.001, saving_s=0.002 * (mb == 0),
                            metrics={"loss": float(step + mb)} if n.name == "f0" else {})
            for n in spec.nodes if step % max(n.every, 1) == 0
            for mb in range(spec.microbatches if n.per_microbatch else 1)]


def shuffled_events(spec: pb.JobSpec, seed: int, window: int = 3) -> Iterator[pb.InstanceDone | tuple[str, int]]:
    """Every instance of every step, interleaved over ``window`` steps in flight, with each slice's commits
    (``("s0", 8)``) heard in between, some twice, some before the slices without states got there."""
    rng = random.Random(seed)
    pending: list[pb.InstanceDone | tuple[str, int]] = []
    for step in range(spec.steps):
        pending.extend(instances(spec, step))
        if spec.checkpoint_every and step and step % spec.checkpoint_every == 0:
            pending.extend((s.slice, step) for s in spec.slices if s.slice.startswith("s"))
        if step >= window:
            rng.shuffle(pending)
            for _ in range(len(pending) // 2):
                ev = pending.pop()
                yield ev
                if rng.random() < 0.05:
                    yield ev  # heard again (a replay's)
    rng.shuffle(pending)
    yield from pending


def scanned_cut(committed: dict[str, set[int]], cut: int, reached: int) -> int:
    """The cut as JobProgress worked it out by scanning every slice's commits on every event."""
    return max((c for c in set.intersection(*committed.values()) if c <= reached), default=cut)


@pytest.mark.parametrize("seed", range(6))
def test_completion_and_the_cut_are_those_of_the_scan_on_a_randomized_event_sequence(seed: int) -> None:
    spec = chain(5)
    p = JobProgress(spec, Graph.from_spec(spec))
    committed: dict[str, set[int]] = {s: set() for s in ("s0", "s1", "s2", "s3", "s4")}
    heard: dict[int, int] = {}
    done: list[int] = []
    rng = random.Random(seed)
    for ev in shuffled_events(spec, seed):
        if isinstance(ev, tuple):
            s, step = ev
            before = p.cut
            if rng.random() < 0.1 and step in committed[s]:  # a commit that did not restore stops counting
                p.drop_commit(s, step)
                committed[s].discard(step)
                continue
            moved = p.commit(s, step)
            if step >= before:
                committed[s].add(step)
            want = scanned_cut(committed, before, p.stateless_through)
            assert p.cut == max(want, before) and moved == (want if want > before else None)
            committed = {k: {c for c in v if c >= p.cut} for k, v in committed.items()}
            continue
        if p.instance(ev):
            heard[ev.step] = heard.get(ev.step, 0) + 1
        for d in p.complete():
            done.append(d.step)
            assert heard[d.step] == instances_per_step(spec, d.step)
        while len(done) < spec.steps and heard.get(len(done), 0) == instances_per_step(spec, len(done)):
            raise AssertionError(f"step {len(done)} has every instance and did not complete")
        before = p.cut
        want = scanned_cut(committed, before, p.stateless_through)
        assert p.recut() == (want if want > before else None) and p.cut == max(want, before)
        committed = {k: {c for c in v if c >= p.cut} for k, v in committed.items()}
    assert done == list(range(spec.steps)) and p.cut == max(set.intersection(*committed.values()), default=p.cut)


def test_restored_commits_count_again_from_the_cut_restored() -> None:
    spec = eval_spec()
    p = JobProgress(spec, Graph.from_spec(spec))
    for s in ("s0", "s1"):
        p.commit(s, 5)
    assert p.cut == 0  # the evaluator has not passed step 5
    assert p.restored(0, {"s0": [5, 10], "s1": [10]}) is None
    for step in range(11):
        for ev in instances(spec, step):
            p.instance(ev)
        p.complete()
    assert p.recut() == 10 and p.cut == 10  # 5 no longer counts (s1's is gone); 10 does


def test_a_step_works_out_its_instances_once_not_once_per_event(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = chain(16, steps=6, checkpoint_every=0, stateless=0)
    calls: list[int] = []
    monkeypatch.setattr(progress_module, "instances_per_step",
                        lambda spec, step: calls.append(step) or instances_per_step(spec, step))
    p = JobProgress(spec, Graph.from_spec(spec))
    for step in range(spec.steps):
        for ev in instances(spec, step):
            p.instance(ev)
            p.complete()
    assert p.completed == spec.steps and sorted(set(calls)) == list(range(spec.steps)) and len(calls) <= 2 * spec.steps


def test_an_event_without_a_new_commit_reads_no_slices_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = chain(16, steps=8, checkpoint_every=4, stateless=2)
    p = JobProgress(spec, Graph.from_spec(spec))
    looked: list[str] = []
    through = JobProgress.done_through
    monkeypatch.setattr(JobProgress, "done_through", lambda self, node: looked.append(node) or through(self, node))
    for step in range(spec.steps):
        for ev in instances(spec, step):
            p.instance(ev)
            p.complete()
            assert p.recut() is None
    assert looked == []  # no commit was heard: nothing to intersect, no slice's progress read
    for i in range(16):
        p.commit(f"s{i}", 4)
    assert p.cut == 4 and looked  # the last slice's commit makes step 4 whole: the stateless slices were asked


# -- the straggler watch ------------------------------------------------------------------------------------


class ScanningWatch(StragglerWatch):
    """The watch as it dropped its marks before: a scan of every slice's marks and work on every event."""

    def advanced(self) -> None:
        if self.settings.mode == "off":
            return
        progress, now = self.port.progress, self.clock.monotonic()
        for s in range(max(self._granted, progress.completed), progress.granted):
            self.granted_at.setdefault(s, now)
        self._granted = max(self._granted, progress.granted)
        busy = self.port.busy()
        if busy and not busy.startswith("every step"):
            self._disturbed()
        while self._judged < progress.completed:
            s = self._judged
            self._judged += 1
            self.finished_at[s] = now
            self._measure(s)
        for by_step, keep_from in ((self.slice_done, self._judged - 2), (self.heard_in, self._judged - 2),
                                   (self.save_s, self._judged - 2 - self._checkpoint_every())):
            for old in [k for k in by_step if k[0] < keep_from]:
                del by_step[old]
        oldest = min((a for by_slice in self.spans.values() for xs in by_slice.values() for a, _ in xs), default=now)
        for s, xs in self.work.items():
            self.work[s] = [x for x in xs if x[1] > oldest]
        for marks, keep_from in ((self.heard, self._judged - 2), (self.spans, self._judged - 2),
                                 (self.granted_at, self._judged - 2),
                                 (self.finished_at, self._judged - 2 * self.settings.window - 2)):
            for old in [s for s in marks if s < keep_from]:
                del marks[old]

    def _disturbed(self) -> None:
        self._quiet_from = max(self._quiet_from, self.port.progress.completed + self.settings.window)
        for q in self.recent.values():
            q.clear()
        self._recent_steps.clear()


class Port:
    """The job as the watch reads it: a progress moved by the test, nothing busy, every slice on its own worker."""

    def __init__(self, spec: pb.JobSpec) -> None:
        self.progress = SimpleNamespace(completed=0, granted=2, start=0)
        self.places = {s.slice: SimpleNamespace(worker=f"w-{s.slice}", members=()) for s in spec.slices}
        self.busy_now = ""
        self.events: list[tuple[str, dict[str, Any]]] = []

    def busy(self) -> str:
        return self.busy_now

    def placement(self) -> dict[str, Any]:
        return self.places

    def event(self, event: str, step: int = 0, **detail: Any) -> None:
        self.events.append((event, {k: v for k, v in detail.items() if k != "at"}))


def watches(spec: pb.JobSpec) -> tuple[list[StragglerWatch], list[Port], FakeClock]:
    clock = FakeClock()
    made, ports = [], []
    for cls in (StragglerWatch, ScanningWatch):
        port = Port(spec)
        w = cls(spec, port, clock=clock, log=FakeLog())  # type: ignore[arg-type]
        w.configure(StragglerSettings(mode="report", window=4, persist=2), spec.checkpoint_every)
        made.append(w)
        ports.append(port)
    return made, ports, clock


def marks(w: StragglerWatch) -> tuple[Any, ...]:
    return (w.heard_in, w.slice_done, w.save_s, w.heard, w.spans, w.granted_at, w.finished_at,
            {s: xs for s, xs in w.work.items() if xs}, w.baseline, {s: list(q) for s, q in w.recent.items()},
            w._judged, w._quiet_from, w.decisions)


@pytest.mark.parametrize("seed", range(4))
def test_the_watch_keeps_the_marks_and_says_what_the_scan_did_on_a_randomized_event_sequence(seed: int) -> None:
    spec = chain(6, steps=60, checkpoint_every=5)
    (new, old), ports, clock = watches(spec)
    rng = random.Random(seed)
    heard: dict[tuple[str, int], set[int]] = {}
    for ev in shuffled_events(spec, seed):
        if isinstance(ev, tuple):
            continue
        clock.advance(rng.expovariate(1 / 0.004) + (0.05 if ev.node == "f3" and ev.step > 30 else 0.0))  # s3 slows
        if rng.random() < 0.01:
            clock.advance(1.0)  # the job stood still
        first = ev.microbatch not in heard.setdefault((ev.node, ev.step), set())
        heard[(ev.node, ev.step)].add(ev.microbatch)
        for w, port in zip((new, old), ports):
            port.busy_now = "recovery 1 runs" if 20 <= ev.step < 22 else ""
            if first:
                w.instance(ev)
            port.progress.completed = done_through(spec, heard)
            port.progress.granted = min(port.progress.completed + 2, spec.steps)
            w.advanced()
        assert marks(new) == marks(old)
        assert ports[0].events == ports[1].events
    assert new.baseline and new._judged == spec.steps and new.recent  # measured and judged to the end


def done_through(spec: pb.JobSpec, heard: dict[tuple[str, int], set[int]]) -> int:
    s = 0
    while s < spec.steps and all(len(heard.get((n.name, s), ())) == (spec.microbatches if n.per_microbatch else 1)
                                 for n in spec.nodes if s % max(n.every, 1) == 0):
        s += 1
    return s


class CountingDict(dict):  # type: ignore[type-arg]
    """A slice -> work dict that counts the scans of every slice."""

    scans = 0

    def items(self) -> Any:
        CountingDict.scans += 1
        return super().items()


def test_an_event_drops_old_marks_without_a_scan_of_every_slice() -> None:
    spec = chain(32, steps=12, checkpoint_every=0, stateless=0)
    (w, _), ports, clock = watches(spec)
    w.work = CountingDict()
    events = 0
    for step in range(spec.steps):
        for ev in instances(spec, step):
            clock.advance(0.001)
            w.instance(ev)
            events += 1
            ports[0].progress.completed = step + (ev.node == f"f{31}" and (ev.microbatch == 0))
            ports[0].progress.granted = min(ports[0].progress.completed + 2, spec.steps)
            w.advanced()
    assert CountingDict.scans < events // 8, f"{CountingDict.scans} scans of every slice's work in {events} events"
    assert w.work and all(len(xs) <= 4 * spec.microbatches for xs in w.work.values())  # old work was dropped


class CountingStore(MemoryStore):
    """A store that counts its round trips (and can be away)."""

    def __init__(self) -> None:
        super().__init__()
        self.trips, self.away = 0, False

    def get(self, key: str) -> Any:
        self.trips += 1
        if self.away:
            raise StoreError("etcd away")
        return super().get(key)

    def txn(self, compares: Any, success: Any, failure: Any = ()) -> Any:
        self.trips += 1
        if self.away:
            raise StoreError("etcd away")
        return super().txn(compares, success, failure)


def test_the_periodic_check_of_registrations_reads_them_in_a_few_round_trips_not_one_per_worker() -> None:
    store, keys, clock = CountingStore(), Keys("t"), FakeClock()
    n = 205
    incs = {f"w{i:03d}": register_worker(store, keys, f"w{i:03d}", 1) for i in range(n)}
    term = JobTerm("j", store=store, keys=keys, election=FakeElection(store, keys, clock), clock=clock, log=FakeLog())
    store.revoke_lease(store.get(keys.worker("w007")).lease)  # gone
    store.delete(keys.worker("w150"))
    register_worker(store, keys, "w150", 1)  # registered again: another incarnation
    store.trips = 0
    lost = term.gone(incs | {"w999": 1})  # never registered
    assert sorted(lost) == ["w007", "w150", "w999"] and all("registration is gone" in why for why in lost.values())
    assert store.trips <= 3, f"{store.trips} round trips to etcd for 206 registrations"
    store.away = True
    assert term.gone(incs) == {}  # etcd away: nobody is lost for that


def test_the_marks_remember_the_lowest_step_of_every_dict_they_drop_from() -> None:
    m = Marks()
    done, heard, saves = {(3, "s0"): 1.0, (9, "s1"): 1.0}, {(7, "s0"): 1, (8, "s1"): 1}, {(5, "s0"): 0.1}
    m.low, m.low_save = 1, 5
    m.drop_old((done, heard), 2, saves, 0)  # nothing that old: kept, and the lowest step is 3 (of the first dict)
    assert m.low == 3 and len(done) == 2 and len(heard) == 2
    m.drop_old((done, heard), 5, saves, 6)
    assert done == {(9, "s1"): 1.0} and heard == {(7, "s0"): 1, (8, "s1"): 1} and saves == {}
    assert m.low == 7 and m.low_save == NEVER
    m.drop_old((done, heard), 7, saves, 6)  # nothing below 7: no scan, nothing dropped
    assert m.low == 7 and len(heard) == 2
