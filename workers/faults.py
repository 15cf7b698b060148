"""Fault hooks of a worker, for tests and the chaos harness (never set in production).

They are injected, not read from the environment: the worker daemon takes them as
hidden options (``--fault-commit-delay-s``, ``--fault-storage-flag``,
``--fault-corrupt-replicas``, ``--fault-corrupt-flag``), the local
cluster passes :attr:`rallypoint.cluster.local.LocalClusterConfig.worker_faults` to
every worker it starts, and the daemon hands them through the runtime to each job's
checkpoints (:mod:`rallypoint.workers.runtime.checkpoints`) and its state updates
(:mod:`rallypoint.workers.corruption`).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from rallypoint.basics.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class WorkerFaults:
    """Faults a worker injects into its own checkpoints and state.

    Attributes:
        commit_delay_s: seconds each checkpoint commit waits after Orbax finalized the
            checkpoint, so a kill can land while a checkpoint is on disk but does not
            count yet (0: no delay).
        storage_flag: a file; while it exists, every checkpoint save fails with the
            errno named in it (``ENOSPC``, ``EROFS``; empty or unknown: ``EIO``). This is
            how ``chaos/storage.py`` fills or freezes the disk without root ("": off).
        corrupt_replicas: every checkpoint copy this worker holds in memory for a peer
            (:mod:`rallypoint.workers.checkpoints.replicas`) gets one byte flipped when stored, so a
            restore from it fails its checksum and reads the disk.
        corrupt_flag: a file of ``corrupt`` specs (:mod:`rallypoint.workers.corruption`): the state updates they
            name get one bit flipped, silently ("": off, and nothing can arm it).
    """

    commit_delay_s: float = 0.0
    storage_flag: str = ""
    corrupt_replicas: bool = False
    corrupt_flag: str = ""

    def __post_init__(self) -> None:
        if not self.commit_delay_s >= 0:
            raise ConfigError(f"commit_delay_s must be >= 0, got {self.commit_delay_s}")

    @property
    def any(self) -> bool:
        """Whether any fault is set."""
        return self != NO_FAULTS

    def args(self) -> list[str]:
        """The worker daemon's options that set these faults (none for the defaults)."""
        out: list[str] = []
        if self.commit_delay_s:
            out += ["--fault-commit-delay-s", repr(float(self.commit_delay_s))]
        if self.storage_flag:
            out += ["--fault-storage-flag", self.storage_flag]
        if self.corrupt_replicas:
            out += ["--fault-corrupt-replicas"]
        if self.corrupt_flag:
            out += ["--fault-corrupt-flag", self.corrupt_flag]
        return out

    def check_storage(self, where: str) -> None:
        """Raise the injected storage error while the flag file exists.

        Raises:
            OSError: with the errno named in the flag file.
        """
        if not self.storage_flag or not os.path.exists(self.storage_flag):
            return
        try:
            name = Path(self.storage_flag).read_text().strip()
        except OSError:  # removed in between: the fault is over
            return
        code = getattr(errno, name or "EIO", errno.EIO)
        raise OSError(code, f"{os.strerror(code)} (injected by the storage flag {self.storage_flag})", where)


NO_FAULTS = WorkerFaults()
"""The production setting: no faults."""
