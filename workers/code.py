"""The job's code bundles on this worker: each unpacked once per hash into the worker's own cache.

A job with host sources ships its code as a zip (``client/bundle.py``) that the coordinator
keeps in the run directory, ``<run>/code/<sha256>.zip``: the filesystem every worker
mounts, as for checkpoints. :class:`CodeCache` checks the zip's sha256 against the
hash the load names (a damaged or swapped file is refused), unpacks it into a private
directory of this worker (a path that would land outside it is refused) and keeps it
for every later load of the same hash; the directory goes with the worker.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import uuid
import zipfile
from pathlib import Path, PurePosixPath

from rallypoint.basics.errors import RallypointError


class CodeError(RallypointError):
    """A code bundle cannot be used: missing, not the bytes its hash names, or not a safe zip."""


class CodeCache:
    """Unpacked code bundles by sha256, under a directory of this worker (made on first use)."""

    def __init__(self, root: Path | None = None) -> None:
        self._root = root
        self._own = root is None  # a private temporary directory: removed by close()
        self._lock = threading.Lock()
        self.unpacked: dict[str, Path] = {}

    def get(self, run_dir: str | Path, sha256: str) -> Path:
        """The directory holding bundle ``sha256`` of the run in ``run_dir``, unpacked once.

        Raises:
            CodeError: the bundle is missing, its bytes hash otherwise, or an entry would land outside.
        """
        with self._lock:
            if sha256 in self.unpacked:
                return self.unpacked[sha256]
            if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
                raise CodeError(f"code bundle hash {sha256!r} is not a sha256 in hex")
            path = Path(run_dir) / "code" / f"{sha256}.zip"
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise CodeError(f"the job's code bundle {path} cannot be read: {exc}") from exc
            got = hashlib.sha256(data).hexdigest()
            if got != sha256:
                raise CodeError(f"the job's code bundle {path} hashes to {got}, not to {sha256}: it was changed "
                                "after the submit; submit the job again")
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix="rallypoint-code-"))
            dest = self._root / sha256
            tmp = self._root / f".{sha256[:12]}-{uuid.uuid4().hex[:8]}"
            try:
                _unzip(path, tmp)
                if dest.exists():
                    shutil.rmtree(dest)
                os.replace(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            self.unpacked[sha256] = dest
            return dest

    def close(self) -> None:
        """Remove the cache's directory, if this cache made it."""
        with self._lock:
            if self._own and self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)
                self._root = None
            self.unpacked.clear()


def _unzip(path: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                rel = PurePosixPath(info.filename)
                if rel.is_absolute() or ".." in rel.parts or info.filename.startswith("\\"):
                    raise CodeError(f"the job's code bundle {path} has an entry {info.filename!r} outside its root")
                z.extract(info, dest)
    except zipfile.BadZipFile as exc:
        raise CodeError(f"the job's code bundle {path} is not a zip: {exc}") from exc
