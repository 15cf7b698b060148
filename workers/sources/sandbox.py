"""What a host source's process may reach: not the worker's keys, not its environment, not other jobs' code.

A host source runs code a client submitted (docs/security.md, "Submitted code"). Its process
(:mod:`rallypoint.workers.sources.child`) is started by :class:`~rallypoint.workers.sources.host.HostSource`:

* with a scrubbed environment (:func:`source_env`): an allow-list (``PATH``, ``HOME``, the locale,
  ``PYTHONPATH``, JAX's and XLA's settings, a few thread counts) and a ``TMPDIR`` of its own; never the
  worker's TLS paths, etcd endpoints or any credential in its environment. The job's own settings
  come shipped in its bundle (``basics/settings.py``);
* restricted before it imports the job's code (:func:`apply`): where the kernel has Landlock,
  the process reads everything but the hidden folders (the worker's TLS directory and those given
  by ``--source-hide``) and ``/dev``'s other devices, writes only its ``TMPDIR``, ``/dev/shm``, the
  user's cache folder (``~/.cache``: data prepared on first use) and the ``--source-write`` folders,
  never the worker's code cache (every job's unpacked code is read-only to it), and cannot
  ptrace, read the memory or environment of, or (Landlock ABI >= 6) signal a process outside it.
  A source whose worker runs as root also drops every capability first, so root's powers do not
  reach around the sandbox;
* where Landlock is missing, the process runs unrestricted but for the environment and the
  capabilities, and says so in the worker's log (``source.unsandboxed``); ``--source-sandbox
  required`` makes that a refusal instead (the job fails naming the reason).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rallypoint.workers.sources import landlock

ENV_NAMES = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM", "PYTHONPATH", "PYTHONHASHSEED",
             "XDG_CACHE_HOME",
             "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "OPENBLAS_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL", "MPLCONFIGDIR")
"""The worker's environment variables a source's process gets (besides ``LC_*``, ``JAX_*`` and ``XLA_*``)."""
ENV_PREFIXES = ("LC_", "JAX_", "XLA_")
ENV_DROPPED = ("XLA_PYTHON_CLIENT_PREALLOCATE",)
SANDBOX_MODES = ("auto", "required", "off")
"""``--source-sandbox``: restrict where the kernel can (``auto``), refuse to run a source where it cannot
(``required``), or only scrub the environment (``off``: a trusted cluster)."""


@dataclass(frozen=True)
class SourcePolicy:
    """What the worker hides from its sources, and how hard it insists (the daemon's ``--source-*`` options)."""

    hide: tuple[str, ...] = ()
    write: tuple[str, ...] = ()  # besides its TMPDIR, /dev/shm and the user's cache folder (``--source-write``)
    mode: str = "auto"
    extra: Mapping[str, str] = field(default_factory=dict)  # tests: variables set on top of the allow-list

    def args(self, tmpdir: str, code: str) -> str:
        """The child's sandbox argument (JSON): paths only, never a secret. ``code``: the folder of the unpacked
        bundles (read-only to it, whatever ``write`` says)."""
        return json.dumps({"hide": list(self.hide), "write": [tmpdir, cache_folder(), *self.write],
                           "read_only": [code], "mode": self.mode})


def cache_folder() -> str:
    """The user's cache folder (``XDG_CACHE_HOME``, else ``~/.cache``): where data loaders keep what they prepare
    (the LM example's token file, by default)."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


def source_env(environ: Mapping[str, str], tmpdir: str, extra: Mapping[str, str] = ()) -> dict[str, str]:  # type: ignore[assignment]
    """The environment of a source's process: the allow-listed part of ``environ``, its own ``TMPDIR``, JAX on the
    CPU only (it must not take the worker's accelerators)."""
    env = {k: v for k, v in environ.items()
           if (k in ENV_NAMES or k.startswith(ENV_PREFIXES)) and k not in ENV_DROPPED}
    env.update(dict(extra))
    env.update(TMPDIR=tmpdir, JAX_PLATFORMS="cpu")
    return env


def tls_folders(paths: Iterable[str | Path]) -> tuple[str, ...]:
    """The folders of a worker's TLS files (its CA, certificate and key): what its sources must not read."""
    return tuple(dict.fromkeys(str(Path(p).absolute().parent) for p in paths if p))


def _drop_capabilities() -> None:
    """Root's process gives up every capability, for good (the bounding set too): no mount, no module, no
    ptrace, no reading around file permissions."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the kernel's last: ignored)
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    data = (Data * 2)()
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), data) != 0:  # _LINUX_CAPABILITY_VERSION_3, all zero
        raise OSError(ctypes.get_errno(), "capset: " + os.strerror(ctypes.get_errno()))


def apply(arg: str) -> str:
    """In the source's process, before the job's code is imported: restrict it as ``arg`` (:meth:`SourcePolicy.args`)
    says. Returns what holds, for the log; raises PermissionError when ``required`` cannot be met."""
    spec = json.loads(arg) if arg else {}
    mode = spec.get("mode", "auto")
    if mode == "off" or not sys.platform.startswith("linux"):
        return "unsandboxed: " + ("--source-sandbox off" if mode == "off" else f"no Landlock on {sys.platform}")
    held = []
    if os.geteuid() == 0:
        _drop_capabilities()
        held.append("capabilities dropped")
    try:
        version = landlock.restrict(spec.get("hide", ()), spec.get("write", ()), spec.get("read_only", ()))
    except OSError as exc:
        if mode == "required":
            raise PermissionError(f"the worker runs with --source-sandbox required, and Landlock cannot restrict "
                                  f"this source: {exc}") from None
        return f"unsandboxed ({', '.join(held) or 'environment scrubbed only'}): Landlock: {exc}"
    return f"sandboxed: Landlock ABI {version}, hidden {spec.get('hide', [])}" + (f", {held[0]}" if held else "")
