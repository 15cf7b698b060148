"""The errors of a worker's runtime, below every part that raises them (the runtime, its
checkpoints, a gang's checkpoints): a load that cannot run, a value that matches no input, a
checkpoint that does not read back as committed."""

from __future__ import annotations

from typing import Any

from rallypoint.basics.errors import RallypointError


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
    def corrupt(cls, exc: Any) -> RestoreError:
        """A ``workers.checkpoint.CheckpointCorrupt`` as a load's typed failure (the executor drops its commit)."""
        c = exc.commit
        return cls(f"corrupt checkpoint slice={c.slice_name} step={c.step}: {exc}", slice_name=c.slice_name,
                   step=c.step)
