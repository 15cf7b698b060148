"""The local cluster's side of its zygote (:mod:`rallypoint.cluster.zygote`): where its socket lives, and a
worker asked of it."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SOCKET_NAME = "zygote.sock"
READY_WAIT_S = 15.0
"""How long a first fork waits for the zygote's socket before the worker is started the usual way."""


class ZygoteError(OSError):
    """The zygote could not fork a worker (not up, gone, or it refused the request)."""


_PREFIX = "rallypoint-zygote-"


def socket_dir() -> Path:
    """A new folder for a zygote's socket, mode 0700 (a socket path is limited to ~100 bytes: not the state dir)."""
    return Path(tempfile.mkdtemp(prefix=_PREFIX))


def remove_socket(argv: list[str]) -> None:
    """Remove the socket folder of the zygote started with ``argv`` (its last argument is the socket): only a
    folder :func:`socket_dir` makes (``argv`` may come from a ``cluster.json`` someone edited)."""
    if not argv:
        return
    folder = Path(argv[-1]).parent
    if folder.name.startswith(_PREFIX) and folder.parent == Path(tempfile.gettempdir()):
        shutil.rmtree(folder, ignore_errors=True)


def fork(sock: Path, argv: list[str], *, env: dict[str, str], log: Path, cwd: Path,
         alive: Callable[[], bool] = lambda: True, wait_s: float = READY_WAIT_S) -> int:
    """Ask the zygote at ``sock`` for a worker running ``argv`` (``python -m rallypoint.cluster.daemons ...``:
    what follows the module); its pid. A zygote still importing is waited for while ``alive()``, at most
    ``wait_s``. Raises :class:`ZygoteError`."""
    request = json.dumps({"argv": argv, "env": env, "log": str(log), "cwd": str(cwd)}).encode() + b"\n"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as c:
                c.settimeout(wait_s)
                c.connect(str(sock))
                c.sendall(request)
                answer = c.makefile("rb").readline(64)
            break
        except (FileNotFoundError, ConnectionRefusedError) as exc:  # not listening yet
            if time.monotonic() > deadline or not alive():
                raise ZygoteError(f"the zygote at {sock} did not answer (alive: {alive()}; waited at most "
                                  f"{wait_s:g} s): {exc}") from None
            time.sleep(0.02)
        except OSError as exc:
            raise ZygoteError(f"the zygote at {sock} failed: {exc}") from None
    try:
        return int(answer)
    except ValueError:
        raise ZygoteError(f"the zygote at {sock} answered {answer[:64]!r}, not a pid") from None
