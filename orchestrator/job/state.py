"""A job's lifecycle on the leader: its states, the allowed transitions, how it ends.

::

    PLACING -> LOADING -> RUNNING <-> RECOVERING, RUNNING -> FINISHING -> SUCCEEDED
    FINISHING -> RECOVERING (a worker lost while the final state is fetched; back to FINISHING by RUNNING)
    RUNNING -> STOPPING -> SUSPENDED | CANCELLED (an operator's suspend or cancel, or a
        higher-priority job's suspend: held at a step boundary, saved there, every device released)
    STOPPING -> RECOVERING (a worker lost during the stop; the stop goes on once the job runs again)
    any state before SUCCEEDED -> CANCELLED (a cancel without a final checkpoint: at once)
    any state that is not final -> FAILED (with a reason), or HANDED_OFF (this leader's
    term ended: the job goes on under the next leader, which adopts it)

SUSPENDED and CANCELLED end the executor but not the run: its directory and commits are
kept, and ``rallypoint resume`` continues it (:data:`RECORD_TRANSITIONS`: the moves of the
job *record* between executors, which the service makes: SUSPENDED -> CANCELLED, and a
resume's SUSPENDED | CANCELLED | FAILED -> PLACING).

:meth:`rallypoint.orchestrator.job.executor.JobExecutor._set_state` is the one way to move,
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
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SUSPENDED = "suspended"
    CANCELLED = "cancelled"
    HANDED_OFF = "handed_off"

    @property
    def is_terminal(self) -> bool:
        """The executor ends in this state (the run may go on: a suspended or cancelled job resumes)."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.SUSPENDED, JobState.CANCELLED,
                        JobState.HANDED_OFF)


S = JobState
_ENDS = frozenset({S.FAILED, S.HANDED_OFF})
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.PLACING: frozenset({S.PLACING, S.LOADING, S.CANCELLED}) | _ENDS,
    S.LOADING: frozenset({S.RUNNING, S.CANCELLED}) | _ENDS,
    S.RUNNING: frozenset({S.RECOVERING, S.FINISHING, S.STOPPING, S.CANCELLED}) | _ENDS,
    S.RECOVERING: frozenset({S.RUNNING, S.RECOVERING, S.CANCELLED}) | _ENDS,
    S.FINISHING: frozenset({S.SUCCEEDED, S.RECOVERING, S.CANCELLED}) | _ENDS,
    S.STOPPING: frozenset({S.SUSPENDED, S.CANCELLED, S.RECOVERING}) | _ENDS,
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.SUSPENDED: frozenset(),
    S.CANCELLED: frozenset(),
    S.HANDED_OFF: frozenset(),
}
"""Allowed moves of one executor. RECOVERING -> RECOVERING: a loss during a recovery starts the next one."""

RECORD_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.SUSPENDED: frozenset({S.CANCELLED, S.PLACING}),  # cancelled while set aside; resumed
    S.CANCELLED: frozenset({S.PLACING}),  # resumed: the run goes on from its cut
    S.FAILED: frozenset({S.PLACING}),  # resumed
    S.SUCCEEDED: frozenset(),
}
"""Moves of a settled job's record between executors (the service's: a cancel of a suspended job, a resume)."""

FINAL_RECORD_STATES = frozenset({S.SUCCEEDED.value, S.FAILED.value, S.SUSPENDED.value, S.CANCELLED.value})
"""Job records in these states run nowhere; any other state is a job a new leader adopts."""

END_EVENTS = frozenset({"job.finished", "job.failed", "job.suspended", "job.cancelled"})
"""The executor's last event when the job stopped running (a client stops following it)."""
STREAM_END_EVENTS = END_EVENTS | {"job.handed_off"}
"""The executor's last event: after ``job.handed_off`` the job goes on under the next leader."""


def record_transition(old: str, new: JobState, job: str) -> None:
    """Check a move of a settled job's record (``old``: its recorded state) to ``new``.

    Raises:
        JobStateError: naming the job, both states and what can be done instead.
    """
    try:
        current = JobState(old)
    except ValueError:
        raise JobStateError(f"job {job!r} is recorded as {old!r}, which is no state of a job") from None
    if new not in RECORD_TRANSITIONS.get(current, frozenset()):
        raise JobStateError(f"job {job!r} is {current.value}: it cannot become {new.value}")


class JobStateError(RallypointError):
    """A move the job's transition table does not allow (a verb that does not apply to the job now)."""


class JobStopped(RallypointError):
    """The job stopped on request (suspend or cancel): ``state`` is where it ends, the message why."""

    def __init__(self, state: JobState, message: str) -> None:
        super().__init__(message)
        self.state = state


class JobFailed(RallypointError):
    """The job cannot go on; the message is the reason recorded and reported."""


class HandedOff(RallypointError):
    """This executor's leader term ended: the job goes on under the next leader."""
