"""Linux Landlock through ctypes: restrict this process (and all it starts) to the files it is granted.

Landlock (Linux >= 5.13, unprivileged) is an allow-list of file hierarchies and the rights on
each. :func:`restrict` turns "everything but these folders, read-only; these folders writable"
into that form: every proper ancestor of a hidden folder is granted listing only, each of its
other entries is granted reading, so a hidden folder (and a file in it, by any path: a symlink,
``/proc/PID/root/...``) cannot be opened. ``/dev`` gets its harmless devices only. A
restricted process also cannot ptrace (nor read ``/proc/PID/environ`` or ``mem`` of) any process
outside its domain, and from ABI 6 on it cannot signal one.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from pathlib import Path

_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446  # the same on every architecture (generic syscall table)
_VERSION = 1  # LANDLOCK_CREATE_RULESET_VERSION
_PATH_BENEATH = 1  # LANDLOCK_RULE_PATH_BENEATH
PR_SET_NO_NEW_PRIVS = 38

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
TRUNCATE, IOCTL_DEV = 1 << 14, 1 << 15
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # the only rights a rule on a file may hold
READ = EXECUTE | READ_FILE | READ_DIR
_SCOPE_SIGNAL = 1 << 1
DEV_READABLE = ("null", "zero", "full", "random", "urandom")
DEV_WRITABLE = ("null", "shm")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The kernel's Landlock ABI version; 0 when it has none (not Linux, too old, or turned off)."""
    try:
        v = _libc().syscall(_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(v), 0)


def _handled(version: int) -> int:
    bits = 13 if version == 1 else 14 if version == 2 else 15 if version in (3, 4) else 16
    return (1 << bits) - 1


def _real(paths: Iterable[str | Path]) -> set[Path]:
    return {Path(os.path.realpath(p)) for p in paths if p and os.path.exists(p)}


def plan(hide: Iterable[str | Path], write: Iterable[str | Path],
         read_only: Iterable[str | Path] = ()) -> list[tuple[Path, int]]:
    """The (path, rights) rules granting read everywhere but ``hide`` and ``/dev``'s other devices, and all rights
    in ``write``, less any folder of ``write`` that holds a hidden or a ``read_only`` one (rights only add up)."""
    kept = _real(hide) | _real(read_only)
    writable = {w for w in _real(write) if not any(w == k or w in k.parents for k in kept)}
    hidden = _real(hide) | {Path("/dev")}
    ancestors = {a for h in hidden for a in h.parents}
    rules: list[tuple[Path, int]] = [(a, READ_DIR) for a in sorted(ancestors)]
    for a in sorted(ancestors):
        try:
            entries = list(os.scandir(a))
        except OSError:
            continue
        for e in entries:
            p = Path(e.path)
            if p in ancestors or p in hidden or e.is_symlink():
                continue  # a symlink's target is granted (or not) where it lies
            rules.append((p, READ if e.is_dir(follow_symlinks=False) else EXECUTE | READ_FILE))
    rules.append((Path("/dev"), READ_DIR))
    rules += [(Path("/dev") / d, READ) for d in DEV_READABLE]
    rules += [(Path("/dev") / d, -1) for d in DEV_WRITABLE]
    rules += [(p, -1) for p in sorted(writable)]
    return rules


def restrict(hide: Iterable[str | Path], write: Iterable[str | Path], read_only: Iterable[str | Path] = ()) -> int:
    """Restrict this process for good (:func:`plan`); returns the ABI used. OSError when the kernel refuses."""
    version = abi()
    if version < 1:
        raise OSError("Landlock is not available on this kernel")
    libc = _libc()
    handled = _handled(version)
    attr = _RulesetAttr(handled, 0, _SCOPE_SIGNAL if version >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if version >= 6 else 8
    ruleset = libc.syscall(_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset: " + os.strerror(ctypes.get_errno()))
    try:
        for path, rights in plan(hide, write, read_only):
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # gone meanwhile, or not there on this host
            try:
                is_dir = os.path.isdir(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else path.is_dir()
                allowed = handled if rights == -1 else rights & handled
                if not is_dir:
                    allowed &= _FILE_RIGHTS
                rule = _PathBeneath(allowed, fd)
                if libc.syscall(_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_PATH_BENEATH), ctypes.byref(rule),
                                ctypes.c_uint32(0)) < 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"landlock_add_rule {path}: {os.strerror(err)}")
            finally:
                os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_RESTRICT, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")
    finally:
        os.close(ruleset)
    return version
