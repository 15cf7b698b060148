"""Storage faults for the checkpoint directory: full, or read-only, mid-run.

As root, the cluster's checkpoint directory is a small tmpfs mounted for the run:
``fill`` writes a file until the filesystem answers ENOSPC; ``freeze`` bind-mounts
the directory over itself read-only (a plain ``remount,ro`` is refused while files
are open for writing), so every new write through the path fails with EROFS;
``unfill`` / ``thaw`` undo them. Otherwise the fault is injected at the
storage layer: workers started with the storage flag :attr:`Storage.faults` names
(``WorkerFaults.storage_flag``, the worker's hidden ``--fault-storage-flag``) fail every
checkpoint save with the errno named in that file while it exists
(``workers/faults.py``). ``mode`` says which was used.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any

from rallypoint.basics.errors import RallypointError
from rallypoint.workers.faults import NO_FAULTS, WorkerFaults

TMPFS_SIZE = "64m"


class StorageError(RallypointError):
    """The checkpoint directory could not be set up or faulted."""


def _run(*argv: str) -> None:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if r.returncode != 0:
        raise StorageError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip()}")


class Storage:
    """Controls the checkpoint directory ``directory`` of one local cluster."""

    def __init__(self, directory: Path, *, prefer_tmpfs: bool = True) -> None:
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.flag = self.directory.parent / "storage-fault"
        self.mode = "injected-error"
        self.mounted = False
        self.frozen = False
        if prefer_tmpfs and os.geteuid() == 0:
            try:
                _run("mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(self.directory))
                self.mounted, self.mode = True, f"tmpfs ({TMPFS_SIZE})"
            except StorageError:
                self.mode = "injected-error"

    @property
    def faults(self) -> WorkerFaults:
        """What workers must be started with (the injected-error mode; nothing on a tmpfs)."""
        return NO_FAULTS if self.mounted else WorkerFaults(storage_flag=str(self.flag))

    def fill(self) -> dict[str, Any]:
        if not self.mounted:
            self.flag.write_text("ENOSPC")
            return {"mode": self.mode, "errno": "ENOSPC"}
        written = 0
        with open(self.directory / ".chaos-filler", "wb") as f:
            chunk = b"\0" * (1 << 20)
            try:
                while True:
                    f.write(chunk)
                    f.flush()
                    written += len(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        return {"mode": self.mode, "filled_bytes": written}

    def unfill(self) -> dict[str, Any]:
        if not self.mounted:
            self.flag.unlink(missing_ok=True)
        else:
            (self.directory / ".chaos-filler").unlink(missing_ok=True)
        return {"freed": True}

    def freeze(self) -> dict[str, Any]:
        if not self.mounted:
            self.flag.write_text("EROFS")
        else:
            _run("mount", "--bind", str(self.directory), str(self.directory))
            try:
                _run("mount", "-o", "remount,bind,ro", str(self.directory))
            except StorageError:
                _run("umount", "-l", str(self.directory))
                raise
            self.frozen = True
        return {"mode": self.mode, "read_only": True}

    def thaw(self) -> dict[str, Any]:
        if not self.mounted:
            self.flag.unlink(missing_ok=True)
        elif self.frozen:
            _run("umount", "-l", str(self.directory))  # the read-only bind mount; the tmpfs below stays
            self.frozen = False
        return {"read_only": False}

    def close(self) -> None:
        """Undo everything; the directory's content goes with the tmpfs."""
        self.flag.unlink(missing_ok=True)
        if self.frozen:
            subprocess.run(["umount", "-l", str(self.directory)], capture_output=True)
            self.frozen = False
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.directory)], capture_output=True)
            self.mounted = False
