"""Handing a loaded job's states to its checkpoints: when a slice saves, what, and what it reports.

:class:`CheckpointHandoff` stands between the scheduler and
:class:`rallypoint.workers.runtime.checkpoints.JobCheckpoints`. A slice's device thread asks
it whether a checkpoint is due (every instance of the slice below the checkpoint step
has run, none above: :meth:`CheckpointHandoff.due`), takes the slice's states as at
the start of that step (:meth:`CheckpointHandoff.snapshot`) and saves them
(:meth:`CheckpointHandoff.save`). Each state's version for its slice's next
checkpoint is pinned, so the save can read it even once its uses are spent. The time
a save blocked the slice's loop is reported with the slice's next instance
(``InstanceDone.saving_s``); a commit is reported on the job's event stream
(``checkpoint_slice`` / ``checkpoint_step``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.runtime.checkpoints import CommitFn, JobCheckpoints
from rallypoint.workers.faults import WorkerFaults
from rallypoint.workers.checkpoints.replicas import Replicator, ReplicaTier
from rallypoint.workers.residency import Copies
from rallypoint.workers.runtime.control import JobControl
from rallypoint.workers.runtime.state import Leaves, StateVersions


class CheckpointHandoff:
    """The checkpoints of one job's slices on this worker, as its device threads see them.

    Owns ``checkpoints`` (:class:`~rallypoint.workers.runtime.checkpoints.JobCheckpoints`: when each
    slice saves, the Orbax saves, the commits), ``replicator`` (the in-memory tier's copies of
    each commit, :mod:`rallypoint.workers.checkpoints.replicas`; None: disk only), the pins of the resident
    states and each slice's blocking save time not yet reported.

    Args:
        req: the load request (checkpoint settings; which slice holds each state).
        control: the job's control (the lock; events; the log).
        states: the resident states (read and pinned here).
        commit_factory: makes this incarnation's checkpoint commit (None: no checkpoints).
        faults: test fault hooks of the job's checkpoints (:mod:`rallypoint.workers.faults`).
        replicas: the worker's in-memory checkpoint tier (None: disk only).
        copies: where the states' copies off the device are counted (``checkpoint``).
        gangs: slice -> the maker of its checkpointer, for each multi-host slice here (its members save their
            own shards: :class:`~rallypoint.workers.gang.checkpoint.GangCheckpointer`).
    """

    def __init__(self, req: pb.LoadJobRequest, control: JobControl, states: Mapping[str, StateVersions], *,
                 commit_factory: Callable[[], CommitFn] | None, faults: WorkerFaults,
                 replicas: ReplicaTier | None, copies: Copies | None = None,
                 gangs: Mapping[str, Any] | None = None) -> None:
        self._control = control
        self._states = states
        self._steps = int(req.steps)
        self._state_slice = {st.name: st.slice for st in req.states}
        self._saving_s: dict[str, float] = {}  # slice -> its loop's blocking save time not yet reported (saving_s)
        self.replicator: Replicator | None = (replicas.replicator(req, incarnation=control.incarnation, log=control.log)
                                              if replicas else None)
        self.checkpoints = JobCheckpoints(req, commit_factory=commit_factory, on_commit=self._committed, faults=faults,
                                          log_fields={"worker": control.worker_id, "incarnation": control.incarnation},
                                          replicate=self.replicator.submit if self.replicator else None,
                                          copies=copies, gangs=gangs, on_verified=self._verified)
        for name, sv in states.items():  # keep each state's value for its slice's next checkpoint
            sv.pin(int(min(self.checkpoints.barrier(self._state_slice[name]), self._steps)))

    # -- the slice's device thread, under the job's lock ----------------------------------

    def barrier(self, slice_name: str) -> float:
        """The slice runs no instance of this step or later until it saved it (inf: no checkpoints)."""
        return self.checkpoints.barrier(slice_name)

    def due(self, slice_name: str, low: int) -> int | None:
        """The step the slice saves now, given ``low``: every instance of the slice below it has started."""
        return self.checkpoints.due(slice_name, low)

    def snapshot(self, slice_name: str, step: int) -> dict[str, Leaves | None]:
        """The slice's states as at the start of ``step`` (None: a state with no such value, a bug)."""
        return {name: sv.at(step) for name, sv in self._states.items() if self._state_slice[name] == slice_name}

    def take_saving_s(self, slice_name: str) -> float:
        """The slice's blocking save time since its last instance (reported once)."""
        return self._saving_s.pop(slice_name, 0.0)

    # -- the slice's device thread, outside the lock ---------------------------------------

    def save(self, slice_name: str, step: int, cut: dict[str, Leaves | None]) -> None:
        """Save the slice's ``cut`` as its checkpoint at ``step``; the time it blocked counts as saving_s."""
        t0 = time.perf_counter()
        self._save(slice_name, step, cut)
        self._saving_s[slice_name] = self._saving_s.get(slice_name, 0.0) + time.perf_counter() - t0

    def _save(self, slice_name: str, step: int, cut: dict[str, Leaves | None]) -> None:
        """Save the slice's states as at the start of ``step``.

        A save that fails (storage full or read-only, say) is skipped and logged: the
        cut stays where it was, recovery keeps using older checkpoints, and the next
        checkpoint step tries again.
        """
        control = self._control
        missing = sorted(name for name, v in cut.items() if v is None)
        if missing:  # a bookkeeping bug: fail the job loudly
            with control.cv:
                control.fail_job(f"checkpoint of slice {slice_name!r} at step {step}: states {missing} have no value")
            return
        try:
            self.checkpoints.save(slice_name, step, {name: list(v or []) for name, v in cut.items()})
        except Exception as exc:  # noqa: BLE001 - training goes on; the checkpoint just does not count
            control.log.error("checkpoint.skipped", slice=slice_name, step=step, error=f"{type(exc).__name__}: {exc}")
            with control.cv:
                self.checkpoints.save_failed(slice_name, step)  # the final cut is tried again until it counts
        with control.cv:
            nxt = self.checkpoints.barrier(slice_name)
            for name, sv in self._states.items():
                if self._state_slice[name] == slice_name:
                    sv.pin(int(min(nxt, self._steps)))

    def _committed(self, slice_name: str, step: int) -> None:
        with self._control.cv:
            self._control.publish(pb.InstanceDone(checkpoint_slice=slice_name, checkpoint_step=step))

    def _verified(self, state: pb.VerifiedState) -> None:
        with self._control.cv:
            self._control.publish(pb.InstanceDone(verified=state))

    # -- the runtime -----------------------------------------------------------------------

    def save_at(self, step: int) -> None:
        """Every slice also saves at ``step`` (a drain), off the schedule. Under the lock."""
        self.checkpoints.save_at(step)

    def set_cut(self, cut: int) -> None:
        """The job's newest consistent cut: older checkpoints may go."""
        self.checkpoints.set_cut(cut)
