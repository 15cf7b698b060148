"""The job's code bundles on this worker: each unpacked once per hash into the worker's own cache.

A job with host sources ships its code as a zip (``client/bundle.py``) that the coordinator
keeps in the run directory, ``<run>/code/<sha256>.zip``: the filesystem every worker
mounts, as for checkpoints. :class:`CodeCache` checks the zip's sha256 against the
hash the load names (a damaged or swapped file is refused), unpacks those very bytes (one
read: what was hashed is what is unpacked) into a private directory of this worker and
keeps it for every later load of the same hash; the directory goes with the worker (a killed
worker's is swept by the next worker on the host: :mod:`rallypoint.workers.scratch`).
A bundle is refused whole when an entry would land outside its directory (an absolute
path, ``..``, a symlink) or when it holds more than :data:`MAX_ENTRIES` entries or
unpacks to more than :data:`MAX_UNPACKED_BYTES`. Once unpacked, its files and folders are
read-only (``0444``/``0555``), and host sources see the cache only read-only
(:mod:`rallypoint.workers.sources.sandbox`): one job's source cannot change the code of another.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import threading
import uuid
import zipfile
from pathlib import Path, PurePosixPath

from rallypoint.basics.errors import RallypointError
from rallypoint.basics.trusted_files import UntrustedFile, read_bounded
from rallypoint.workers.scratch import remove_tree, scratch_dir

MAX_BUNDLE_BYTES = 256 * 2**20
"""The largest code bundle read (the coordinator takes a submit of at most 256 MiB, its code included)."""
MAX_UNPACKED_BYTES = 1 << 30
"""The most bytes a code bundle may unpack to (1 GiB): a zip that would expand past it is refused."""
MAX_ENTRIES = 20_000
"""The most entries (files and folders) a code bundle may hold."""


class CodeError(RallypointError):
    """A code bundle cannot be used: missing, not the bytes its hash names, or not a safe zip."""


class CodeCache:
    """Unpacked code bundles by sha256, under a directory of this worker (made on first use)."""

    def __init__(self, root: Path | None = None) -> None:
        self._root = root
        self._own = root is None  # a private temporary directory: removed by close()
        self._lock = threading.Lock()
        self.unpacked: dict[str, Path] = {}

    @property
    def root(self) -> Path | None:
        """The cache's directory (None until the first bundle is unpacked into a private one)."""
        return self._root

    def get(self, run_dir: str | Path, sha256: str) -> Path:
        """The directory holding bundle ``sha256`` of the run in ``run_dir``, unpacked once.

        Raises:
            CodeError: the bundle is missing, its bytes hash otherwise, an entry would land outside, or it is
                over the caps.
        """
        with self._lock:
            if sha256 in self.unpacked:
                return self.unpacked[sha256]
            if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
                raise CodeError(f"code bundle hash {sha256!r} is not a sha256 in hex")
            path = Path(run_dir) / "code" / f"{sha256}.zip"
            try:
                data = read_bounded(path, MAX_BUNDLE_BYTES, "the job's code bundle")
            except UntrustedFile as exc:
                raise CodeError(str(exc)) from None
            except OSError as exc:
                raise CodeError(f"the job's code bundle {path} cannot be read: {exc}") from exc
            got = hashlib.sha256(data).hexdigest()
            if got != sha256:
                raise CodeError(f"the job's code bundle {path} hashes to {got}, not to {sha256}: it was changed "
                                "after the submit; submit the job again")
            if self._root is None:
                self._root = Path(scratch_dir("code"))
            self._root.mkdir(parents=True, exist_ok=True)
            os.chmod(self._root, 0o755)  # sources run with fewer rights (sandbox.py) and read their code here
            dest = self._root / sha256
            tmp = self._root / f".{sha256[:12]}-{uuid.uuid4().hex[:8]}"
            try:
                unzip(data, tmp, str(path))  # the bytes hashed above, not a second read of the file
                if dest.exists():
                    remove_tree(dest)
                os.replace(tmp, dest)
            finally:
                remove_tree(tmp)
            self.unpacked[sha256] = dest
            return dest

    def close(self) -> None:
        """Remove the cache's directory, if this cache made it."""
        with self._lock:
            if self._own and self._root is not None:
                remove_tree(self._root)
                self._root = None
            self.unpacked.clear()


def unzip(data: bytes, dest: Path, name: str) -> None:
    """Unpack the zip ``data`` (the bundle ``name``) into the new directory ``dest``, read-only once done.

    Raises:
        CodeError: not a zip, an entry outside ``dest`` (absolute, ``..``, a symlink), or over the caps.
    """
    dest.mkdir(parents=True)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = z.infolist()
            if len(infos) > MAX_ENTRIES:
                raise CodeError(f"the job's code bundle {name} has {len(infos)} entries, over the limit of "
                                f"{MAX_ENTRIES} (MAX_ENTRIES): ship less code (.rallypointignore, docs/data.md)")
            total = sum(i.file_size for i in infos)  # zipfile never reads past an entry's stated size
            if total > MAX_UNPACKED_BYTES:
                raise CodeError(f"the job's code bundle {name} unpacks to {total} bytes, over the limit of "
                                f"{MAX_UNPACKED_BYTES} (MAX_UNPACKED_BYTES): ship less code or data with it")
            for info in infos:
                _check_entry(info, name)
            written = 0
            for info in infos:
                target = dest.joinpath(*PurePosixPath(info.filename).parts)
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(target, "xb") as out:
                    while chunk := src.read(1 << 20):
                        written += len(chunk)
                        if written > MAX_UNPACKED_BYTES:
                            raise CodeError(f"the job's code bundle {name} unpacks to over {MAX_UNPACKED_BYTES} "
                                            "bytes (MAX_UNPACKED_BYTES)")
                        out.write(chunk)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, NotImplementedError, FileExistsError) as exc:
        raise CodeError(f"the job's code bundle {name} is not a zip it can unpack: {exc}") from exc
    _read_only(dest)


def _check_entry(info: zipfile.ZipInfo, name: str) -> None:
    rel = PurePosixPath(info.filename)
    mode = info.external_attr >> 16
    if (rel.is_absolute() or ".." in rel.parts or "\\" in info.filename or not rel.parts or "\x00" in info.filename
            or info.filename.startswith("/")):
        raise CodeError(f"the job's code bundle {name} has an entry {info.filename!r} outside its root")
    if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):  # a symlink, a device, a fifo
        raise CodeError(f"the job's code bundle {name} has an entry {info.filename!r} that is not a plain file or "
                        "folder (a symlink): a bundle holds files only")


def _read_only(root: Path) -> None:
    for d, dirs, files in os.walk(root):
        for f in files:
            os.chmod(os.path.join(d, f), 0o444)
        os.chmod(d, 0o555)
