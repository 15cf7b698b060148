"""Files read from a shared file system that other hosts can write: read once, bounded, no symlink followed.

The checkpoint root is mounted by every worker host, so a file the coordinator or a
worker acts on there (a run's ``LATEST``, ``jobspec.pb``, a code bundle) may have been
replaced by any of them: with a symlink to ``/dev/zero`` or to a file elsewhere, or with
something far larger than it can be. :func:`read_bounded` opens the last path component
with ``O_NOFOLLOW``, takes only a regular file, and reads at most ``limit`` bytes: one read,
so what is checked (a hash) is what is then used.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from rallypoint.basics.errors import ConfigError


class UntrustedFile(ConfigError):
    """A file on the shared file system is not what it must be: a symlink, not a regular file, or too large."""


def read_bounded(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path`` (not a symlink), at most ``limit`` of them.

    Raises:
        FileNotFoundError: there is no such file.
        UntrustedFile: it is a symlink, not a regular file, or larger than ``limit`` bytes (naming ``what``).
        OSError: it cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in (getattr(os, "ELOOP", 40), getattr(os, "EMLINK", 31)) and os.path.islink(path):
            raise UntrustedFile(f"{what} {path} is a symlink: it is read only as a plain file (another host may "
                                "have replaced it); put the file itself there") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFile(f"{what} {path} is not a regular file (mode {stat.filemode(st.st_mode)}): it is "
                                "read only as a plain file")
        if st.st_size > limit:
            raise UntrustedFile(f"{what} {path} has {st.st_size} bytes, over its limit of {limit}: it is not a "
                                "file Rallypoint wrote there")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise UntrustedFile(f"{what} {path} grew past its limit of {limit} bytes while it was read")
        return data
    finally:
        os.close(fd)


def write_new(directory_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Write ``name`` in the directory open as ``directory_fd`` whole or not at all: a fresh temporary file
    (``O_EXCL|O_NOFOLLOW``: no file or symlink someone planted is written through), then renamed over ``name``."""
    tmp = f".{name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=directory_fd)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, name, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=directory_fd)
        except OSError:
            pass
        raise
