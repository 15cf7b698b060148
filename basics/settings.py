"""A job's settings: the values its job file reads, shipped with its code (docs/data.md, "Job settings").

A job file reads a setting with :func:`setting` (``rallypoint.client.setting``) or takes them
all with :func:`job_config` (``rallypoint.client.job_config``):

* where the job is submitted (the client running the job file), a setting is the value given
  at submit (``rallypoint run JOB.py --set NAME=VALUE``, ``load_program(..., settings=...)``),
  else the client's environment variable of that name, else the default; every value read
  is recorded, and the job's code bundle ships them all (:data:`SETTINGS_FILE` at its root);
* where the job's code runs on a worker (a host source's process), the settings are the
  shipped ones only: the worker's own environment is not read, so workers need not be
  started with the job's variables. The shipped values are also set as environment
  variables of that process (it runs this job's code only), so code that reads
  ``os.environ`` for a name the job file read through :func:`setting` sees the same value.

Values are strings, as environment variables are.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

SETTINGS_FILE = ".rallypoint-settings.json"  # at the root of a job's code bundle

_lock = threading.Lock()
_shipped: dict[str, str] | None = None  # in a job's process on a worker: the settings shipped with its code
_given: dict[str, str] = {}  # at submit: the values given (--set)
_read: dict[str, str] = {}  # at submit: what the job file read, to ship


def setting(name: str, default: str | None = None) -> str | None:
    """The job's setting ``name`` (see the module doc): the value given at submit, else the environment's, else
    ``default``; on a worker, the shipped value, else ``default``."""
    with _lock:
        if _shipped is not None:
            return _shipped.get(name, default)
        value = _given[name] if name in _given else os.environ.get(name, default)
        if value is not None:
            _read[name] = str(value)
        return value


def job_config() -> dict[str, str]:
    """Every setting of the job: on a worker the shipped ones; at submit, the given ones and those read so far."""
    with _lock:
        if _shipped is not None:
            return dict(_shipped)
        return {**_read, **_given}


@contextmanager
def recording(given: Mapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """While a job file loads at submit: ``given`` are the submit's values; the dict yielded is filled, on exit,
    with the settings to ship (the given ones and every one read). The given values stay this process's settings
    after the load (the job's code that runs here later, a reference run's host source, reads the same)."""
    global _given
    out: dict[str, str] = {}
    with _lock:
        _given = {str(k): str(v) for k, v in (given or {}).items()}
        _read.clear()
    try:
        yield out
    finally:
        with _lock:
            out.update({**_read, **_given})


def ship(values: Mapping[str, str], *, environ: bool = True) -> None:
    """In a job's own process on a worker: the settings are ``values`` (and, with ``environ``, its environment
    variables of those names)."""
    global _shipped
    with _lock:
        _shipped = {str(k): str(v) for k, v in values.items()}
    if environ:
        os.environ.update(_shipped)


def load_shipped(bundle_root: str | Path) -> dict[str, str]:
    """The settings shipped in an unpacked bundle ({} when it has none); ValueError when the file is not a
    JSON object of strings."""
    f = Path(bundle_root) / SETTINGS_FILE
    if not f.is_file():
        return {}
    values = json.loads(f.read_text())
    if not isinstance(values, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in values.items()):
        raise ValueError(f"{f} is not a JSON object of strings")
    return values


def encode(values: Mapping[str, str]) -> bytes:
    """The bytes of :data:`SETTINGS_FILE` (sorted keys: the same settings give the same bundle)."""
    return (json.dumps(dict(values), sort_keys=True, indent=1) + "\n").encode()


def parse_assignments(items: list[str] | tuple[str, ...], option: str = "--set") -> dict[str, str]:
    """``NAME=VALUE`` strings as a dict. Raises ValueError naming the bad item."""
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or name != name.strip():
            raise ValueError(f"{option} {item!r} is not NAME=VALUE: give e.g. {option} LM_D_MODEL=64")
        out[name] = value
    return out
