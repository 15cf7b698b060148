"""A worker's scratch folders in the system's temporary directory, and the sweep of a dead worker's.

A worker unpacks code bundles (:mod:`rallypoint.workers.code`) and gives each host source a private
TMPDIR (:mod:`rallypoint.workers.sources.host`) in folders it removes when it closes them. A worker
killed by a signal (a lost host, a chaos kill, an operator's ``kill -9``) removes nothing, so each
folder's name carries the pid of the process that made it and its pid namespace:
``rallypoint-KIND-NS.PID-XXXXXXXX``. A worker starting on the host removes the folders of pids of its
own namespace no longer alive (:func:`sweep_orphans`); a live process's folders, those of another pid
namespace (a container sharing the folder, whose pids this one cannot see) and other users' are left alone.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from rallypoint.basics.logs import get_logger

KINDS = ("code", "source")
_NAME = re.compile(r"^rallypoint-(code|source)-(\d+)\.(\d+)-")


def _namespace() -> int:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``; 0 where there is none)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def scratch_dir(kind: str) -> str:
    """A new private folder for ``kind`` (one of :data:`KINDS`), named with this process's pid namespace and pid."""
    if kind not in KINDS:
        raise ValueError(f"scratch folder kind {kind!r} is not one of {KINDS}")
    return tempfile.mkdtemp(prefix=f"rallypoint-{kind}-{_namespace()}.{os.getpid()}-")


def remove_tree(path: Path) -> None:
    """Remove ``path`` and all beneath it, read-only folders (an unpacked bundle's) included."""
    def writable_then_retry(func, p, _exc):  # type: ignore[no-untyped-def]
        try:
            os.chmod(os.path.dirname(p), 0o755)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o755)
            func(p)
        except OSError:
            pass

    if path.exists() or path.is_symlink():
        shutil.rmtree(path, onerror=writable_then_retry)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def sweep_orphans(tmp: str | Path | None = None) -> list[Path]:
    """Remove this user's scratch folders under ``tmp`` (the system's) whose process is gone; returns them."""
    root = Path(tmp if tmp is not None else tempfile.gettempdir())
    removed: list[Path] = []
    ns = _namespace()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for e in entries:
        m = _NAME.match(e.name)
        if m is None or int(m.group(2)) != ns or int(m.group(3)) == os.getpid():
            continue
        try:
            if not e.is_dir(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _alive(int(m.group(3))):
            continue
        remove_tree(Path(e.path))
        if not os.path.lexists(e.path):
            removed.append(Path(e.path))
    if removed:
        get_logger("rallypoint.worker").info("worker.scratch_swept", folders=len(removed), under=str(root))
    return removed
