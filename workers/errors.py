"""The errors of a worker's runtime, below every part that raises them (the runtime, its
checkpoints, a gang's checkpoints): a load that cannot run, a value that matches no input, a
checkpoint that cannot be saved, committed or read back as committed, a commit refused to a
fenced incarnation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint.basics.errors import Fenced, RallypointError

if TYPE_CHECKING:
    from rallypoint.etcd.commits import CheckpointCommit


class LoadError(RallypointError):
    """A ``LoadJobRequest`` this worker cannot run (bad devices, slices, routes)."""


class DeliveryError(RallypointError):
    """A pushed value that matches no input of the job on this worker."""


class RestoreError(LoadError):
    """A checkpoint to start from does not read back as committed (``slice_name`` at ``step``)."""

    def __init__(self, message: str, *, slice_name: str, step: int) -> None:
        super().__init__(message)
        self.slice_name, self.step = slice_name, step

    @classmethod
    def corrupt(cls, exc: CheckpointCorrupt) -> RestoreError:
        """A :class:`CheckpointCorrupt` as a load's typed failure (the executor drops its commit)."""
        c = exc.commit
        return cls(f"corrupt checkpoint slice={c.slice_name} step={c.step}: {exc}", slice_name=c.slice_name,
                   step=c.step)


class CheckpointError(RallypointError):
    """A checkpoint could not be saved, committed or read."""


class StillCommitted(CheckpointError):
    """Another worker's commit of a checkpoint still counts: its directory stays (only that worker or the job's
    leader may end the commit; the leader does once it is past retention)."""


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint does not restore to the state its checksum names."""

    def __init__(self, commit: CheckpointCommit, actual: str | None, reason: str = "") -> None:
        got = actual if actual is not None else f"none: unreadable ({reason})"
        super().__init__(
            f"checkpoint of job {commit.job!r} slice {commit.slice_name!r} at step {commit.step} "
            f"at {commit.path} is corrupt: committed checksum {commit.checksum}, restored {got}"
        )
        self.commit = commit
        self.actual = actual


class CommitRefused(Fenced):
    """etcd refused a commit: the worker incarnation that made the checkpoint is over."""
