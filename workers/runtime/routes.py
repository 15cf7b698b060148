"""Where a loaded job's values go: the routing table, and handing each value to its consumer.

The coordinator's routes (``recovery/load_plan.py``) say, for each output of a node
loaded here and each resident state read by a consumer on another worker, which
worker (incarnation, addresses) consumes it as which input. :class:`Router` owns that
table and sends each value along it: to :class:`~rallypoint.workers.runtime.inputs.Inputs`
in memory when the consumer is on this worker, else to the
:class:`~rallypoint.workers.runtime.outbox.Outbox` (logged, then pushed). A state is
pushed to each remote consumer once per step the consumer runs at, as soon as the
version that step reads exists and the step is granted (:meth:`Router.pump_state_pushes`).
``rewire`` installs a new table after recovery moved consumers, and sends the moved
ones their logged values again (:meth:`Router.resend`).

A value sent to consumers on other workers leaves the device once: every push of it
(and its entry in the output log) shares one :class:`~rallypoint.workers.residency.HostCopy`,
made by the first push on its own thread; a value for a consumer here stays on the devices.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.residency import Copies, HostCopy
from rallypoint.workers.runtime.control import JobControl
from rallypoint.workers.runtime.inputs import Inputs
from rallypoint.workers.runtime.load import LoadedNode
from rallypoint.workers.runtime.outbox import Outbox
from rallypoint.workers.errors import LoadError
from rallypoint.workers.runtime.state import Leaves, StateVersions, runs_at


@dataclass
class StateRoute:
    """A resident state's route to a consumer on another worker, and the next step to push it for."""

    route: pb.Route
    next_step: int = 0


class Router:
    """The routing table of one job on this worker; routes values under the job's lock.

    Owns the output routes (node -> output -> routes), the state routes with their push
    progress, and nothing else: values go to ``inputs`` or ``outbox``, which keep them.

    Args:
        control: the job's control (identity for the headers, ``until``, ``stopped``).
        nodes: the job's nodes here (routes may only start at one of them).
        resident: the names of the job's states held here (state routes may only start at one).
        states: the resident states (read: their versions, pushed to remote consumers).
        inputs: where values for consumers on this worker go.
        outbox: where values for consumers on other workers go.
        steps: the job's step count.
        start_step: the first step this runtime runs (state pushes start there).
        copies: where the job's host-device copies are counted (None: not counted).
    """

    def __init__(self, control: JobControl, nodes: Mapping[str, LoadedNode], resident: set[str],
                 states: Mapping[str, StateVersions], inputs: Inputs, outbox: Outbox, *, steps: int,
                 start_step: int, copies: Copies | None = None) -> None:
        self._control = control
        self._nodes = nodes
        self._resident = resident
        self._states = states
        self._inputs = inputs
        self._outbox = outbox
        self._steps = steps
        self._start_step = start_step
        self._copies = copies
        self._outputs: dict[str, dict[str, list[pb.Route]]] = {}  # node -> output -> its routes
        self._state_routes: list[StateRoute] = []

    def set_routes(self, routes: Sequence[pb.Route]) -> None:
        """Install the routing table (at load, and again on ``rewire``); state pushes keep their progress.

        All or nothing: every route is checked before any replaces the table in use, so a
        rejected rewire leaves the routes (and the pushes under way) as they were.

        Raises:
            LoadError: a route from a node or state that is not here.
        """
        worker_id = self._control.worker_id
        progress = {(sr.route.state, sr.route.consumer_node, sr.route.arg): sr.next_step for sr in self._state_routes}
        outputs: dict[str, dict[str, list[pb.Route]]] = {}
        state_routes: list[StateRoute] = []
        for r in routes:
            if r.state:
                if r.state not in self._resident:
                    raise LoadError(f"route of state {r.state!r}, which is not resident on worker {worker_id}")
                if r.worker_id != worker_id:  # on this worker it is read in place
                    state_routes.append(StateRoute(r, progress.get((r.state, r.consumer_node, r.arg),
                                                                   self._start_step)))
            elif r.node in self._nodes:
                outputs.setdefault(r.node, {}).setdefault(r.output, []).append(r)
            else:
                raise LoadError(f"route from node {r.node!r}, which is not loaded on worker {worker_id}")
        self._outputs, self._state_routes = outputs, state_routes
        self._outbox.keep_only({(r.worker_id, r.incarnation) for r in routes})

    def push_everies(self, state: str) -> list[int]:
        """The ``every`` of each remote consumer ``state`` is pushed to (what its versions are kept for)."""
        return [sr.route.consumer_every for sr in self._state_routes if sr.route.state == state]

    def send_output(self, node: str, output: str, step: int, mb: int, value: Leaves) -> None:
        """Send an instance's output to every consumer its routes name (one host copy for all remote ones)."""
        shared: HostCopy | None = None
        for r in self._outputs.get(node, {}).get(output, ()):
            header = pb.TransferHeader(job=self._control.job, node=node, output=output, step=step,
                                       microbatch=mb, consumer_node=r.consumer_node, arg=r.arg)
            if r.worker_id != self._control.worker_id and shared is None:
                shared = HostCopy(value, self._copies)
            self.route(r, header, value if r.worker_id == self._control.worker_id else shared)

    def pump_state_pushes(self) -> None:
        """Push each remote consumer every granted step's version of a state once it exists."""
        hi = min(self._control.until, self._steps)
        for sr in self._state_routes:
            sv = self._states[sr.route.state]
            while sr.next_step < hi:
                if not runs_at(sr.next_step, sr.route.consumer_every):
                    sr.next_step += 1  # the consumer does not run at this step: nothing to send
                    continue
                if sv.at(sr.next_step) is None:
                    break
                header = pb.TransferHeader(job=self._control.job, state=sr.route.state, step=sr.next_step,
                                           microbatch=-1, consumer_node=sr.route.consumer_node, arg=sr.route.arg)
                sv.use(sr.next_step)
                self.route(sr.route, header, sv.host_copy(sr.next_step, self._copies))
                sr.next_step += 1

    def resend(self, routes: Sequence[pb.Route], logged: Iterable[tuple[pb.TransferHeader, Leaves]]) -> int:
        """Send logged values again along ``routes`` to their (moved) consumers; returns how many were sent."""
        by_consumer: dict[tuple[str, str], list[pb.Route]] = {}
        for r in routes:
            by_consumer.setdefault((r.consumer_node, r.arg), []).append(r)
        resent = 0
        for header, leaves in logged:
            for r in by_consumer.get((header.consumer_node, header.arg), ()):
                self.route(r, header, leaves, log=False)  # logged already
                resent += 1
        return resent

    @property
    def backlogged(self) -> bool:
        """Whether pushes not yet ended hold more bytes than the log's limit (the producer waits)."""
        return self._outbox.backlogged

    def relieve(self) -> None:
        """Spill the output log back within its limit; holding no lock."""
        self._outbox.relieve()

    def route(self, r: pb.Route, header: pb.TransferHeader, value: Leaves | HostCopy, *, log: bool = True) -> None:
        """Hand ``value`` to the consumer ``r`` names: in memory here (on its devices), else logged
        (unless ``log`` is False) and pushed."""
        control = self._control
        header.to.CopyFrom(pb.Identity(cluster=control.cluster, worker_id=r.worker_id, incarnation=r.incarnation))
        header.from_worker, header.from_incarnation = control.worker_id, control.incarnation
        if r.worker_id == control.worker_id:
            leaves = value.leaves() if isinstance(value, HostCopy) else value
            header.leaves = len(leaves)
            self._inputs.deliver(header, self._inputs.placed(header, leaves))
        elif not control.stopped:
            header.leaves = value.count if isinstance(value, HostCopy) else len(value)
            self._outbox.send(r, header, value, log=log)
