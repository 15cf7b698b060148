"""The replay planner: after slices are lost, which node instances run again. Pure.

Plain data in (the job graph, the lost slices, the committed checkpoint step ``c``,
each producer's output-log coverage, each node's progress), a :class:`ReplayPlan`
out. No etcd, no processes, no JAX.

Model (DESIGN.md, "Failure and recovery"):

* A **value edge** ``p -> n`` carries ``p``'s output of step ``s`` into ``n``'s
  instance of step ``s`` (a gather reads every microbatch of that step). A **state
  edge** ``p -> n`` carries a state ``p`` produces: ``n`` at step ``s`` reads the
  value ``p`` made at its last instance before ``s`` (the init before any).
* The checkpoint at ``c`` is a consistent cut: every state as at the start of step
  ``c`` (``c == 0``: the inits). It is committed only once every node has run all
  its instances of steps ``< c`` (checked: :class:`ValueError` otherwise).
* ``log_from[p]``: ``p``'s outputs of steps ``>= log_from[p]`` can be sent again:
  those of steps ``< done_through[p]`` from its output log, the later ones because
  ``p`` has not made them yet and will. This covers everything ``p`` produces, state
  values included, for readers on its own slice too; a worker that keeps less must
  report a larger ``log_from``. A surviving node missing from ``log_from`` holds
  nothing (``log_from = done_through``), which is always safe.

Rules (:func:`plan_replay`):

1. Every node on a lost slice replays its instances of steps ``[c, done_through)``.
2. A node ``n`` that replays reads, from each producer ``p`` that does not:
   value edges: ``p``'s outputs of ``n``'s replayed steps; state edges: ``p``'s
   values of steps ``>= c`` (the value as at the start of ``c`` comes from the cut:
   a :class:`CutRead`). If the first of those steps is below ``log_from[p]``, ``p``
   can give it no more: ``p`` joins and replays from ``c`` too (its states are
   restored from the cut; nothing else reproduces what it made), and its own
   producers are examined in turn. Nothing else replays; surviving nodes keep
   their progress and go on as their inputs arrive.
3. What survivors re-send (:class:`Resend`): every step a replaying consumer reads
   from a non-replaying producer that the producer had already made.
4. ``restore_states``: the states rolled back to their value at the cut (all states
   of lost slices, and every state whose producer replays). ``restore_slices``: the
   slices that read their checkpoint at ``c`` (lost slices, slices of restored
   states, slices of cut reads). On a surviving slice only those states roll back;
   states whose producer keeps going stay as they are. A pulled-in node that reads
   and produces no state (a source) needs no restore.

Minimality: call a replay set *valid* when it holds every node of the lost slices
and each member's inputs are available as in rule 2. What a replaying node needs
depends only on ``(c, done_through)``, never on which other nodes replay, so the
rule "a member needs a step below ``p``'s log, hence ``p`` is a member" is monotone
and the planner computes its least fixed point: by induction over the order nodes
join, each one belongs to *every* valid set (outside the set, ``p`` neither holds
nor will make the step its consumer needs). The plan's set is valid by
construction, so it is the least valid set, and dropping any pulled-in node leaves
the consumer that pulled it without an input (tests/recovery/test_replay.py checks
both with a brute-force oracle, the first against every subset of survivors on
small graphs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from rallypoint.proto import rallypoint_pb2 as pb

EdgeKind = Literal["value", "state"]
PlanPolicy = Literal["partial", "restart-all"]


@dataclass(frozen=True, slots=True)
class Node:
    """A node: runs at steps divisible by ``every``; ``microbatches`` instances a step if per microbatch."""

    name: str
    slice: str
    per_microbatch: bool = False
    every: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"node {self.name!r}: every must be a positive integer, got {self.every!r}")

    def steps(self, start: int, stop: int) -> range:
        """The steps in ``[start, stop)`` at which this node has an instance."""
        first = -(-start // self.every) * self.every
        return range(first, max(first, stop), self.every)

    def last_before(self, step: int) -> int | None:
        """The node's last instance step before ``step`` (None: none, the state's init)."""
        return None if step <= 0 else (step - 1) // self.every * self.every


@dataclass(frozen=True, slots=True)
class State:
    """A loop-carried value. It lives on its producer's slice; ``producer`` empty: it never changes."""

    name: str
    slice: str
    producer: str = ""


@dataclass(frozen=True, slots=True)
class Edge:
    """``producer``'s output flows to ``consumer``: same step (value) or later steps (state ``state``)."""

    producer: str
    consumer: str
    kind: EdgeKind = "value"
    state: str = ""


@dataclass(frozen=True)
class Graph:
    """A job graph as the replay planner sees it: nodes, edges and states.

    Raises:
        ValueError: duplicate or unknown names, a value edge whose consumer runs at
            steps its producer does not, or a state off its producer's slice.
    """

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...] = ()
    states: tuple[State, ...] = ()
    _nodes: dict[str, Node] = field(init=False, repr=False, compare=False)
    _inputs: dict[str, tuple[Edge, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        nodes: dict[str, Node] = {}
        for n in self.nodes:
            if n.name in nodes:
                raise ValueError(f"node {n.name!r} is declared twice")
            nodes[n.name] = n
        states: dict[str, State] = {}
        for s in self.states:
            if s.name in states:
                raise ValueError(f"state {s.name!r} is declared twice")
            if s.producer:
                if s.producer not in nodes:
                    raise ValueError(f"state {s.name!r} is produced by unknown node {s.producer!r}")
                if nodes[s.producer].slice != s.slice:
                    raise ValueError(f"state {s.name!r} lives on slice {s.slice!r} but its producer "
                                     f"{s.producer!r} runs on {nodes[s.producer].slice!r}")
            states[s.name] = s
        inputs: dict[str, set[Edge]] = {name: set() for name in nodes}
        for e in self.edges:
            for end in (e.producer, e.consumer):
                if end not in nodes:
                    raise ValueError(f"edge {e.producer!r} -> {e.consumer!r} names unknown node {end!r}")
            if e.kind == "value":
                if nodes[e.consumer].every % nodes[e.producer].every:
                    raise ValueError(f"value edge {e.producer!r} -> {e.consumer!r}: the consumer runs every "
                                     f"{nodes[e.consumer].every} steps, at steps where the producer (every "
                                     f"{nodes[e.producer].every}) does not")
            elif e.kind == "state":
                if e.state and (e.state not in states or states[e.state].producer != e.producer):
                    raise ValueError(f"state edge {e.producer!r} -> {e.consumer!r}: state {e.state!r} is not "
                                     f"declared with producer {e.producer!r}")
            else:
                raise ValueError(f"edge {e.producer!r} -> {e.consumer!r}: unknown kind {e.kind!r}")
            inputs[e.consumer].add(e)
        object.__setattr__(self, "_nodes", nodes)
        object.__setattr__(self, "_inputs", {
            n: tuple(sorted(es, key=lambda e: (e.producer, e.kind, e.state))) for n, es in inputs.items()
        })

    @classmethod
    def from_spec(cls, spec: pb.JobSpec) -> Graph:
        """The graph of a job spec: REF and GATHER bindings are value edges, STATE bindings state edges.

        Raises:
            ValueError: a binding names an unknown node or state (see :class:`Graph`).
        """
        states = tuple(State(s.name, s.slice, s.producer_node) for s in spec.states)
        producer_of = {s.name: s.producer for s in states}
        edges: list[Edge] = []
        for n in spec.nodes:
            for b in n.inputs:
                if b.kind in (pb.InputBinding.REF, pb.InputBinding.GATHER):
                    edges.append(Edge(b.node, n.name, "value"))
                elif b.kind == pb.InputBinding.STATE:
                    if b.state not in producer_of:
                        raise ValueError(f"input {b.arg!r} of node {n.name!r} reads unknown state {b.state!r}")
                    if producer_of[b.state]:  # a state nobody produces is constant: no edge
                        edges.append(Edge(producer_of[b.state], n.name, "state", b.state))
        nodes = tuple(Node(n.name, n.slice, n.per_microbatch, max(n.every, 1)) for n in spec.nodes)
        return cls(nodes, tuple(dict.fromkeys(edges)), states)

    def node(self, name: str) -> Node:
        """The node called ``name`` (KeyError if none)."""
        return self._nodes[name]

    def inputs(self, name: str) -> tuple[Edge, ...]:
        """The distinct edges into node ``name``, sorted."""
        return self._inputs[name]

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    @property
    def state_producers(self) -> frozenset[str]:
        """The nodes that produce a state (their slice holds it)."""
        return (frozenset(s.producer for s in self.states if s.producer)
                | frozenset(e.producer for e in self.edges if e.kind == "state"))

    @property
    def slices(self) -> frozenset[str]:
        """Every slice that holds a node or a state."""
        return frozenset(n.slice for n in self.nodes) | frozenset(s.slice for s in self.states)


@dataclass(frozen=True, slots=True)
class NodeReplay:
    """One node's instances to run again: steps ``[from_step, to_step)`` at which it runs."""

    node: str
    slice: str
    from_step: int
    to_step: int
    every: int = 1
    per_microbatch: bool = False

    @property
    def steps(self) -> range:
        """The replayed steps (those divisible by ``every``)."""
        return Node(self.node, self.slice, self.per_microbatch, self.every).steps(self.from_step, self.to_step)

    def instances(self, microbatches: int) -> int:
        """How many instances re-run (``microbatches`` per step for a per-microbatch node)."""
        return len(self.steps) * (microbatches if self.per_microbatch else 1)


@dataclass(frozen=True, slots=True)
class Resend:
    """A surviving ``producer`` re-sends its logged outputs of ``steps`` to the replaying ``consumer``."""

    producer: str
    consumer: str
    kind: EdgeKind
    state: str
    steps: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CutRead:
    """Replaying ``consumer`` reads ``state`` (on ``slice``) as at the start of step c, from the checkpoint."""

    state: str
    slice: str
    consumer: str


@dataclass(frozen=True, slots=True)
class PullIn:
    """Why a surviving ``node`` replays: ``consumer`` needs its output of ``step``; its log starts at ``log_from``."""

    node: str
    consumer: str
    kind: EdgeKind
    step: int
    log_from: int


@dataclass(frozen=True)
class ReplayPlan:
    """What recovery re-runs and where replaying nodes get their inputs (see the module doc)."""

    policy: PlanPolicy
    checkpoint_step: int
    lost_slices: frozenset[str]
    nodes: Mapping[str, NodeReplay]
    pulled_in: Mapping[str, PullIn]
    resend: tuple[Resend, ...]
    cut_reads: tuple[CutRead, ...]
    restore_states: frozenset[str]
    restore_slices: frozenset[str]

    @property
    def replay_set(self) -> frozenset[str]:
        """The nodes that re-run from the checkpoint step (possibly zero instances each)."""
        return frozenset(self.nodes)

    @property
    def empty(self) -> bool:
        """Nothing re-runs and nothing is restored."""
        return not self.nodes and not self.restore_slices

    def instances(self, microbatches: int) -> dict[str, int]:
        """Instances to re-run per replaying node."""
        return {name: r.instances(microbatches) for name, r in sorted(self.nodes.items())}

    def total_instances(self, microbatches: int) -> int:
        """Instances to re-run in all."""
        return sum(self.instances(microbatches).values())


def instances(plan: ReplayPlan, microbatches: int) -> dict[str, int]:
    """Instances ``plan`` re-runs per node (``microbatches`` per step for per-microbatch nodes)."""
    return plan.instances(microbatches)


def plan_replay(
    graph: Graph, *, lost_slices: Iterable[str], checkpoint_step: int,
    log_from: Mapping[str, int], done_through: Mapping[str, int],
) -> ReplayPlan:
    """The least set of nodes to re-run after ``lost_slices`` went down (policy ``partial``).

    Args:
        graph: the job graph.
        lost_slices: slices whose worker was lost.
        checkpoint_step: ``c`` of the last consistent cut every slice committed.
        log_from: per surviving producer, the first step whose outputs it can still
            send (default: its ``done_through``, nothing held).
        done_through: per node, every instance of steps below it has run.

    Raises:
        ValueError: unknown slices or nodes, negative steps, a node missing from
            ``done_through``, or a node that has not passed the cut at ``c``.
    """
    c = checkpoint_step
    lost = frozenset(lost_slices)
    _check(graph, c, done_through, log_from, lost)
    log = {n.name: min(log_from.get(n.name, done_through[n.name]), done_through[n.name]) for n in graph.nodes}
    replay = {n.name: _replay(n, c, done_through[n.name]) for n in graph.nodes if n.slice in lost}
    pulled: dict[str, PullIn] = {}
    queue = sorted(replay)
    while queue:
        consumer = queue.pop(0)
        for e in graph.inputs(consumer):
            if e.producer in replay:
                continue
            from_log, _ = _needs(graph, e, c, done_through[consumer])
            if from_log and from_log[0] < log[e.producer]:
                replay[e.producer] = _replay(graph.node(e.producer), c, done_through[e.producer])
                pulled[e.producer] = PullIn(e.producer, consumer, e.kind, from_log[0], log[e.producer])
                queue.append(e.producer)
    resend: list[Resend] = []
    cut_reads: set[CutRead] = set()
    for consumer in sorted(replay):
        for e in graph.inputs(consumer):
            if e.producer in replay:
                continue
            from_log, from_cut = _needs(graph, e, c, done_through[consumer])
            sent = tuple(t for t in from_log if t < done_through[e.producer])
            if sent:
                resend.append(Resend(e.producer, consumer, e.kind, e.state, sent))
            if from_cut:
                cut_reads.add(CutRead(e.state, graph.node(e.producer).slice, consumer))
    restore_states = frozenset(s.name for s in graph.states if s.slice in lost or s.producer in replay)
    producers = graph.state_producers
    restore_slices = lost | {r.slice for r in cut_reads} | {graph.node(p).slice for p in replay if p in producers}
    return ReplayPlan(
        policy="partial", checkpoint_step=c, lost_slices=lost, nodes=dict(sorted(replay.items())),
        pulled_in=dict(sorted(pulled.items())), resend=tuple(resend),
        cut_reads=tuple(sorted(cut_reads, key=lambda r: (r.consumer, r.state, r.slice))),
        restore_states=restore_states, restore_slices=frozenset(restore_slices),
    )


def restart_all_plan(
    graph: Graph, checkpoint_step: int, done_through: Mapping[str, int], *, lost_slices: Iterable[str] = (),
) -> ReplayPlan:
    """Policy ``restart-all``: every slice restores the cut at ``checkpoint_step``, every node re-runs since.

    What an SPMD job does; compare with :func:`plan_replay` on the same failure.

    Raises:
        ValueError: as :func:`plan_replay`.
    """
    lost = frozenset(lost_slices)
    _check(graph, checkpoint_step, done_through, {}, lost)
    return ReplayPlan(
        policy="restart-all", checkpoint_step=checkpoint_step, lost_slices=lost,
        nodes={n.name: _replay(n, checkpoint_step, done_through[n.name])
               for n in sorted(graph.nodes, key=lambda n: n.name)},
        pulled_in={}, resend=(), cut_reads=(),
        restore_states=frozenset(s.name for s in graph.states), restore_slices=graph.slices,
    )


def _replay(node: Node, c: int, done: int) -> NodeReplay:
    return NodeReplay(node.name, node.slice, c, max(c, done), node.every, node.per_microbatch)


def _needs(graph: Graph, e: Edge, c: int, consumer_done: int) -> tuple[list[int], bool]:
    """What the consumer's replay of ``[c, consumer_done)`` reads over ``e``.

    Returns the producer's steps it needs (sorted) and whether it also reads a
    state's value as at the start of ``c`` (or its init), which the cut holds.
    """
    steps = graph.node(e.consumer).steps(c, consumer_done)
    if e.kind == "value":
        return list(steps), False
    producer = graph.node(e.producer)
    needed: set[int] = set()
    from_cut = False
    for s in steps:
        t = producer.last_before(s)
        if t is None or t < c:
            from_cut = True
        else:
            needed.add(t)
    return sorted(needed), from_cut


def _check(graph: Graph, c: int, done_through: Mapping[str, int], log_from: Mapping[str, int],
           lost: frozenset[str]) -> None:
    if isinstance(c, bool) or not isinstance(c, int) or c < 0:
        raise ValueError(f"checkpoint step must be a non-negative integer, got {c!r}")
    unknown = sorted(lost - graph.slices)
    if unknown:
        raise ValueError(f"lost slices {unknown} are not in the graph; its slices are {sorted(graph.slices)}")
    for what, table in (("done_through", done_through), ("log_from", log_from)):
        strangers = sorted(n for n in table if n not in graph)
        if strangers:
            raise ValueError(f"{what} names unknown nodes {strangers}")
        bad = sorted(n for n, v in table.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0)
        if bad:
            raise ValueError(f"{what} of nodes {bad} must be non-negative integer steps")
    missing = sorted(n.name for n in graph.nodes if n.name not in done_through)
    if missing:
        raise ValueError(f"done_through lacks nodes {missing}: the planner needs every node's progress")
    for n in graph.nodes:
        behind = n.steps(done_through[n.name], c)
        if behind:
            raise ValueError(
                f"node {n.name!r} has not run its instance of step {behind[0]} but the checkpoint at step {c} is "
                "committed: a committed checkpoint is a cut every node has passed (check done_through)"
            )
