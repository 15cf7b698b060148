"""The process a host source runs in: the user's Python, apart from the worker (docs/data.md).

Started by :class:`rallypoint.workers.sources.host.HostSource` as
``python -m rallypoint.workers.sources.child BUNDLE FILE NAME OUTPUTS SANDBOX``: it restricts
itself as ``SANDBOX`` says (:mod:`rallypoint.workers.sources.sandbox`), then imports ``FILE``
of the unpacked code bundle ``BUNDLE`` (the bundle's root first on ``sys.path``, so
the job's own modules import; the job's settings shipped in the bundle set first,
``basics/settings.py``), takes the module-level ``NAME`` and answers each request
line ``"STEP MICROBATCH"`` on stdin, in order, with one JSON header line and the leaves'
bytes on its protocol stream: ``{"s", "m", "leaves": [[dtype, shape], ...], "sum": sha256}``
or ``{"s", "m", "error": traceback}``. The user's prints go to stderr (the worker's
log), never into the protocol. JAX in this process sees the CPU only: a source that
imports JAX must not take the worker's accelerators. It ends when stdin closes, and
with its worker (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import traceback
from typing import Any, BinaryIO

from rallypoint.basics.settings import load_shipped, ship
from rallypoint.workers.sources import sandbox
from rallypoint.workers.sources.values import flat_leaves, leaf_bytes, leaves_checksum


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the closed stdin still ends it


def _load(bundle: str, file: str, name: str) -> Any:
    ship(load_shipped(bundle))  # the job's settings: the shipped values, not this worker's environment
    sys.path.insert(0, bundle)
    path = os.path.join(bundle, *file.split("/"))
    stem = os.path.splitext(os.path.basename(file))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(f"rallypoint_job_{stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{file} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{file} has no callable {name!r} at module level")
    return fn


def _send(out: BinaryIO, header: dict[str, Any], payload: list[Any] = ()) -> None:  # type: ignore[assignment]
    out.write((json.dumps(header) + "\n").encode())
    for a in payload:
        out.write(leaf_bytes(a))
    out.flush()


def main(argv: list[str]) -> int:
    _die_with_parent()
    bundle, file, name, outputs = argv[0], argv[1], argv[2], tuple(argv[3].split(","))
    out = os.fdopen(os.dup(1), "wb")  # the protocol; fd 1 itself now goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    fn: Any = None
    failed = ""
    try:  # before any of the job's code runs: no key of the worker's, no other job's code to write (sandbox.py)
        print(f"host source {name!r} ({file}): {sandbox.apply(argv[4] if len(argv) > 4 else '')}", file=sys.stderr)
    except PermissionError as exc:
        failed = str(exc)
    try:
        if not failed:
            fn = _load(bundle, file, name)
    except BaseException:  # noqa: BLE001 - the user's import: reported with each request
        failed = f"importing {file} failed:\n{traceback.format_exc()}"
    what = f"host source {name!r} ({file})"
    for line in sys.stdin:
        step, mb = (int(x) for x in line.split())
        if failed:
            _send(out, {"s": step, "m": mb, "error": failed})
            continue
        try:
            leaves, _ = flat_leaves(outputs, fn(step, mb), what)
        except BaseException:  # noqa: BLE001 - the user's error, with the user's traceback
            _send(out, {"s": step, "m": mb, "error": traceback.format_exc()})
            continue
        header = {"s": step, "m": mb, "leaves": [[a.dtype.str, list(a.shape)] for a in leaves],
                  "sum": leaves_checksum(leaves)}
        _send(out, header, leaves)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
