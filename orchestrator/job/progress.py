"""A job's progress: the one owner of what has been done, granted and committed.

:class:`JobProgress` alone writes each of these facts; every other part of the job reads
them through its properties and methods (a read-only view), the way raft alone writes
its log and the application only reads ``Storage``:

* ``completed``: steps ``0 .. completed-1`` are done by every node (every instance heard);
* ``granted``: workers may run instances of steps below it (the window in flight), read
  from :attr:`JobProgress.grants` (:mod:`~rallypoint.orchestrator.job.grants`), the one
  owner of the window, the holds, the halt and the refused grants;
* ``start``: the step the job's runtimes started from (0, or the cut it resumed from);
* ``cut``: the newest consistent cut: the newest step every slice with states has a
  commit at and every node of a slice without states has run all its instances below (such
  a slice saves nothing, so no commit says how far it got: restarted from a cut it had not
  reached, it would skip the steps between, and the job would wait on them for ever). It
  goes **up** as commits are heard and **down** when a commit is dropped
  (a checkpoint that did not restore) or a recovery restores from an older cut, so the
  workers are never told to protect a step that no longer counts while releasing the
  one the job now stands on;
* ``log_floor``: node -> the first step its output log holds, where that is past the
  cut (a drained slice's spare logs from the drain step only). A drain returns the
  :class:`LogFloor` its move made and a restart of every runtime is reported to the
  executor, which moves the floor here; it also falls with every cut that passes it;
* the per-step bookkeeping of instances heard, their metrics, and what re-ran
  (``replayed``, ``redone_s``) or ran first (``compute_s``);
* ``halted``: the step a metric was not finite at (``on_nonfinite = "stop"``,
  :mod:`~rallypoint.orchestrator.job.metrics`; kept by the grants): from then on no grant
  widens and no commit past it moves the cut, whatever arrives after.

It does no I/O: the executor feeds it what the workers report and carries out what it
returns (grant the new window, tell the workers the new cut).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from rallypoint.orchestrator.job.grants import Grants
from rallypoint.recovery.load_plan import instances_per_step
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.replay import Graph
from rallypoint.recovery.slices import stateful_slices


@dataclass(frozen=True)
class LogFloor:
    """A decision for the progress: the output logs of ``nodes`` start at ``step`` now (a drain moved their
    slices there: the spares log from the drain step only)."""

    nodes: tuple[str, ...]
    step: int


@dataclass(frozen=True)
class StepDone:
    """A step every node finished, with its metrics (the mean over microbatches)."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


class JobProgress:
    """The progress of one job (see the module doc). Single-threaded: the executor's loop calls it."""

    def __init__(self, spec: pb.JobSpec, graph: Graph) -> None:
        self.spec, self.graph = spec, graph
        self._ckpt_slices = stateful_slices(spec)
        self._stateless_nodes = [n.name for n in spec.nodes if n.slice not in set(self._ckpt_slices)]
        self._mb = {n.name: (spec.microbatches if n.per_microbatch else 1) for n in spec.nodes}
        self._completed = self._start = self._cut = 0
        self.grants = Grants(spec.steps)
        self._committed: dict[str, set[int]] = {s: set() for s in self._ckpt_slices}  # commit steps heard, >= cut
        self._commit_count: Counter[int] = Counter()  # step -> slices of _committed with a commit there
        self._need: tuple[int, int] = (-1, 0)  # (step, its instances): instances_per_step of the step completing
        self._saved: set[tuple[str, int]] = set()  # (slice, step) commits heard (a drain waits for its own)
        self._floor: dict[str, int] = {}
        self._done: dict[tuple[str, int], set[int]] = defaultdict(set)  # (node, step) -> microbatches heard
        self._step_count: Counter[int] = Counter()
        self._metrics: dict[int, list[tuple[str, int, float]]] = defaultdict(list)
        self.replayed: Counter[str] = Counter()  # node -> instances that ran again (replay)
        self.redone_s = 0.0  # device-seconds of those
        self.compute_s: Counter[str] = Counter()  # node -> device-seconds of first runs

    # -- the read-only view ------------------------------------------------------------------

    @property
    def completed(self) -> int:
        return self._completed

    @property
    def granted(self) -> int:
        return self.grants.granted

    @property
    def start(self) -> int:
        return self._start

    @property
    def cut(self) -> int:
        return self._cut

    @property
    def halted(self) -> int | None:
        return self.grants.halted

    @property
    def log_floor(self) -> Mapping[str, int]:
        return MappingProxyType(self._floor)

    @property
    def all_granted(self) -> bool:
        return self.grants.all_granted

    def summary(self) -> dict[str, Any]:
        """What re-ran and what ran first, as ``job.finished`` reports it."""
        return {"replayed_instances": dict(sorted(self.replayed.items())), "redone_s": round(self.redone_s, 4),
                "compute_s": {n: round(v, 4) for n, v in sorted(self.compute_s.items())}}

    def done_through(self, node: str) -> int:
        """Every instance of ``node`` at steps below this has been reported done."""
        n = self.graph.node(node)
        s = self._completed
        while s < self.spec.steps:
            if s % n.every == 0 and len(self._done.get((node, s), ())) < self._mb[node]:
                return s
            s += 1
        return self.spec.steps

    @property
    def stateless_through(self) -> int:
        """Every node of the slices without states has run all its instances below this step (the job's steps when
        there are none): no cut may pass it, since such a slice restarts from the cut with nothing to restore."""
        return min((self.done_through(n) for n in self._stateless_nodes), default=self.spec.steps)

    def saved(self, slice_name: str, step: int) -> bool:
        """Whether the slice's commit at ``step`` was heard."""
        return (slice_name, step) in self._saved

    # -- starting ------------------------------------------------------------------------------

    def begin(self, start: int, commits: Mapping[str, Iterable[int]] = MappingProxyType({})) -> None:
        """The runtimes start from ``start`` (0, or the cut resumed from), with the job's ``commits`` (slice -> steps)."""
        self._start = self._completed = start
        self.grants.begin(start)
        self._cut = start
        self._committed = {s: {int(c) for c in commits.get(s, ()) if int(c) >= start} for s in self._ckpt_slices}
        self._count_commits()

    def rewind(self, cut: int, commits: Mapping[str, Iterable[int]]) -> None:
        """The job rolled back (job/rollback.py): every runtime starts again from ``cut`` with ``commits``
        (slice -> steps) counting; what was heard of the steps from the cut on is forgotten, the log floor reset."""
        self._done.clear()
        self._step_count.clear()
        self._metrics.clear()
        self._need = (-1, 0)
        self._saved = {(s, c) for s, c in self._saved if c <= cut}
        self._floor = {}
        self.begin(cut, commits)

    # -- instances and steps ---------------------------------------------------------------------

    def instance(self, item: pb.InstanceDone) -> bool:
        """An instance reported done. True when it ran for the first time (False: a replay re-ran it)."""
        step, node = int(item.step), item.node
        if step < self._completed or item.microbatch in self._done[(node, step)]:
            self.replayed[node] += 1
            self.redone_s += item.compute_s
            return False
        self._done[(node, step)].add(item.microbatch)
        self._step_count[step] += 1
        self.compute_s[node] += item.compute_s
        self._metrics[step].extend((name, item.microbatch, v) for name, v in item.metrics.items())
        return True

    def complete(self) -> list[StepDone]:
        """Every step that is now done by every node, in order (``completed`` moves past them)."""
        out = []
        while self._completed < self.spec.steps and self._step_count[self._completed] == self._instances(self._completed):
            s = self._completed
            by_name: dict[str, list[tuple[int, float]]] = defaultdict(list)
            for name, mb, v in self._metrics.pop(s, []):
                by_name[name].append((mb, v))
            out.append(StepDone(s, {name: float(np.mean([v for _, v in sorted(vals)]))
                                    for name, vals in by_name.items()}))
            for n in self.spec.nodes:
                self._done.pop((n.name, s), None)
            del self._step_count[s]
            self._completed += 1
        return out

    def _instances(self, step: int) -> int:
        """:func:`instances_per_step` of ``step``, worked out once per step (every event asks it of the same step)."""
        if self._need[0] != step:
            self._need = (step, instances_per_step(self.spec, step))
        return self._need[1]

    def widen(self, window: int) -> bool:
        """:meth:`Grants.widen` from the steps completed. True: workers are to be granted."""
        return self.grants.widen(self._completed, window)

    # -- the cut ----------------------------------------------------------------------------------

    def commit(self, slice_name: str, step: int) -> int | None:
        """A slice's checkpoint commit was heard. Returns the new cut when it moved (None: it did not).
        Once halted, a commit past the halting step does not count."""
        if self.grants.halted is not None and step > self.grants.halted:
            return None
        self._saved.add((slice_name, step))
        if slice_name in self._committed and step >= self._cut and step not in self._committed[slice_name]:
            self._committed[slice_name].add(step)
            self._commit_count[step] += 1
        return self._recut()

    def recut(self) -> int | None:
        """Steps were completed: a commit heard before the slices without states passed its step counts now (the
        final cut's, which no later commit follows). Returns the new cut when it moved."""
        return self._recut()

    def drop_commit(self, slice_name: str, step: int) -> None:
        """A commit stops counting (its checkpoint did not restore); the recovery that found it restores
        from an older cut and says so (:meth:`restored`), which lowers the cut."""
        self._saved.discard((slice_name, step))
        if step in self._committed.get(slice_name, ()):
            self._committed[slice_name].discard(step)
            self._commit_count[step] -= 1

    def restored(self, cut: int, commits: Mapping[str, Iterable[int]]) -> int | None:
        """Runtimes restored from ``cut``; ``commits`` (slice -> steps) are those that still count (etcd's, less
        any at or past a cut that did not restore).

        The cut becomes ``cut``: lower than before when a recovery fell back past a commit
        that did not restore. Commits heard before and not in ``commits`` stop counting.
        Returns the new cut when it moved.
        """
        self._committed = {s: {int(c) for c in commits.get(s, ()) if int(c) >= cut} for s in self._ckpt_slices}
        self._count_commits()
        self._saved = {(s, c) for s, c in self._saved if c in self._committed.get(s, {c})}
        old, self._cut = self._cut, cut
        self._floor = {n: f for n, f in self._floor.items() if f > cut}
        return None if cut == old else cut

    def _recut(self) -> int | None:
        """Raise the cut to the newest step every slice with states has a commit at and the nodes of the slices
        without states have passed (None: it stays). A commit above their progress counts once a later commit
        is heard after they passed it."""
        if not self._ckpt_slices:
            return None
        every = len(self._ckpt_slices)  # steps every slice with states has a commit at, above the cut
        full = [c for c, n in self._commit_count.items() if n == every and c > self._cut]
        if not full:  # the cut cannot rise (the common case: nothing new to intersect, no scan of the slices)
            return None
        reached = self.stateless_through
        cut = max((c for c in full if c <= reached), default=self._cut)
        if cut <= self._cut:
            return None
        self._cut = cut
        for s in self._ckpt_slices:
            self._committed[s] = {c for c in self._committed[s] if c >= cut}
        self._count_commits()
        self._floor = {n: f for n, f in self._floor.items() if f > cut}
        return cut

    def _count_commits(self) -> None:
        """Count again, per step, the slices with a commit there (after ``_committed`` was set anew)."""
        self._commit_count = Counter(c for steps in self._committed.values() for c in steps)

    # -- output logs --------------------------------------------------------------------------------

    def floor(self, nodes: Iterable[str], step: int) -> None:
        """The output logs of ``nodes`` start at ``step`` (their slices moved there by a drain, :class:`LogFloor`)."""
        for n in nodes:
            self._floor[n] = step

    def reset_floor(self) -> None:
        """Every runtime restarts from the cut: no log starts past it."""
        self._floor = {}
