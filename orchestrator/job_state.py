"""A job's lifecycle on the leader: its states, the allowed transitions, how it ends.

::

    PLACING -> LOADING -> RUNNING <-> RECOVERING, RUNNING -> FINISHING -> SUCCEEDED
    FINISHING -> RECOVERING (a worker lost while the final state is fetched; back to FINISHING by RUNNING)
    any state that is not final -> FAILED (with a reason), or HANDED_OFF (this leader's
    term ended: the job goes on under the next leader, which adopts it)

:meth:`rallypoint.orchestrator.executor.JobExecutor._set_state` is the one way to move,
and it refuses a transition not in :data:`TRANSITIONS`.
"""

from __future__ import annotations

import enum

from rallypoint.basics.errors import RallypointError


class JobState(enum.Enum):
    PLACING = "placing"
    LOADING = "loading"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHING = "finishing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    HANDED_OFF = "handed_off"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.HANDED_OFF)


S = JobState
_ENDS = frozenset({S.FAILED, S.HANDED_OFF})
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.PLACING: frozenset({S.PLACING, S.LOADING}) | _ENDS,
    S.LOADING: frozenset({S.RUNNING}) | _ENDS,
    S.RUNNING: frozenset({S.RECOVERING, S.FINISHING}) | _ENDS,
    S.RECOVERING: frozenset({S.RUNNING, S.RECOVERING}) | _ENDS,
    S.FINISHING: frozenset({S.SUCCEEDED, S.RECOVERING}) | _ENDS,
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.HANDED_OFF: frozenset(),
}
"""Allowed moves. RECOVERING -> RECOVERING: a loss during a recovery starts the next one."""

FINAL_RECORD_STATES = frozenset({S.SUCCEEDED.value, S.FAILED.value})
"""Job records in these states are over; any other state is a job a new leader adopts."""


class JobFailed(RallypointError):
    """The job cannot go on; the message is the reason recorded and reported."""


class HandedOff(RallypointError):
    """This executor's leader term ended: the job goes on under the next leader."""
