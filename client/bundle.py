"""The job's code bundle: the directory of the job file packed for the workers (docs/data.md).

A host source is plain Python that runs on the worker holding its slice, so the workers
need the job's code. The client packs a directory (the job file's, or ``--code DIR``)
into a zip, the way Ray's ``working_dir`` ships a job's files: sorted paths, fixed
timestamps and modes, so the same files give the same bytes and the same sha256. What
is left out: version control, virtual environments and caches (:data:`IGNORED_DIRS`,
:data:`IGNORED_FILES`), symbolic links, and every pattern of a ``.rallypointignore``
file at the root (one ``fnmatch`` pattern per line, matched against the path relative
to the root and against the name). Past ``limit`` bytes of files the pack is refused,
naming the largest files: data belongs on the checkpoint filesystem every worker
mounts, or small, in the bundle.

The coordinator keeps the bundle in the run directory under its sha256; each worker
unpacks it once per hash (:mod:`rallypoint.workers.code`). Nothing is pickled: code
crosses as files, programs as ``jax.export`` bytes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rallypoint.client.program import ProgramError

DEFAULT_LIMIT_BYTES = 32 * 2**20
"""Files of at most this many bytes in all are shipped (the coordinator takes a submit of up to 256 MiB)."""
IGNORE_FILE = ".rallypointignore"
IGNORED_DIRS = (".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".tox", ".mypy_cache", ".pytest_cache",
                ".ruff_cache", "node_modules", ".rallypoint", "*.egg-info", ".ipynb_checkpoints")
IGNORED_FILES = ("*.pyc", "*.pyo", ".DS_Store")


@dataclass(frozen=True)
class Bundle:
    """A packed code directory: the zip's bytes, their sha256, how many files."""

    root: Path
    zip: bytes
    sha256: str
    files: int
    file_bytes: int


def _patterns(root: Path) -> list[str]:
    f = root / IGNORE_FILE
    if not f.is_file():
        return []
    return [line.strip().rstrip("/") for line in f.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _ignored(rel: str, name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(name, p) for p in patterns)


def bundle_files(root: Path) -> list[tuple[str, Path]]:
    """The files a bundle of ``root`` holds: (path relative to the root, "/"-separated; the file), sorted."""
    patterns = _patterns(root)
    out: list[tuple[str, Path]] = []
    for here, dirs, files in os.walk(root):
        base = Path(here)
        rel_base = base.relative_to(root).as_posix()
        keep = []
        for d in sorted(dirs):
            rel = d if rel_base == "." else f"{rel_base}/{d}"
            if not (base / d).is_symlink() and not _ignored(rel, d, list(IGNORED_DIRS) + patterns):
                keep.append(d)
        dirs[:] = keep
        for f in sorted(files):
            rel = f if rel_base == "." else f"{rel_base}/{f}"
            p = base / f
            if p.is_symlink() or not p.is_file() or _ignored(rel, f, list(IGNORED_FILES) + patterns):
                continue
            out.append((rel, p))
    return sorted(out)


def pack(root: str | Path, *, limit_bytes: int = DEFAULT_LIMIT_BYTES, extra: dict[str, bytes] | None = None) -> Bundle:
    """Pack ``root`` into a deterministic zip; ``extra``: files made here (path in the bundle -> bytes), in place
    of any file of that path (the job's settings, ``basics/settings.py``).

    Raises:
        ProgramError: ``root`` is not a directory, or its files are over ``limit_bytes``.
    """
    r = Path(root).resolve()
    if not r.is_dir():
        raise ProgramError(f"code directory {str(root)!r} is not a directory")
    files = bundle_files(r)
    total = sum(p.stat().st_size for _, p in files)
    if total > limit_bytes:
        largest = sorted(files, key=lambda f: -f[1].stat().st_size)[:5]
        names = ", ".join(f"{rel} ({p.stat().st_size / 2**20:.1f} MiB)" for rel, p in largest)
        raise ProgramError(
            f"the code bundle of {r} holds {total / 2**20:.1f} MiB of files, over the limit of "
            f"{limit_bytes / 2**20:.0f} MiB (largest: {names}). Leave files out with a {IGNORE_FILE} file "
            "(fnmatch patterns), or give --code a smaller directory; data files belong on the filesystem "
            "every worker mounts (docs/data.md)"
        )
    entries: dict[str, Path | bytes] = {rel: p for rel, p in files} | dict(extra or {})
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as z:
        for rel, p in sorted(entries.items()):
            info = zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, p if isinstance(p, bytes) else p.read_bytes())
    data = buf.getvalue()
    return Bundle(r, data, hashlib.sha256(data).hexdigest(), len(entries), total)


def relative_to_bundle(bundle_root: Path, file: str | Path, what: str) -> str:
    """``file``'s path inside the bundle of ``bundle_root`` ("/"-separated).

    Raises:
        ProgramError: ``file`` is outside the bundle.
    """
    p = Path(file).resolve()
    try:
        return p.relative_to(bundle_root).as_posix()
    except ValueError:
        raise ProgramError(f"{what} is defined in {p}, outside the code directory {bundle_root}: give "
                           "--code a directory that holds it") from None
