"""Typed errors on the wire: what a refused RPC says beyond its status code.

A worker that fails an RPC for a reason the coordinator must act on attaches it as
trailing metadata (key :data:`ERROR_KEY`, a JSON object with a ``kind``), so the
coordinator reads a typed value instead of parsing the message. Today's kinds:

* ``corrupt_checkpoint`` with ``slice`` and ``step``: a checkpoint of the cut failed
  to restore (status DATA_LOSS); its commit stops counting.
* ``program_failed`` with ``part`` (e.g. ``state 'params' init``, ``node 'train'``) and
  ``error``: the job's own program failed on the worker, deterministically (an
  exception in an init, an XLA compile error, out of device memory, a shape error;
  status INTERNAL): no worker is to blame, the job fails.
* ``member_lost`` with ``worker`` and ``error``: the worker leads a multi-host slice whose
  member on ``worker`` was lost while the call ran (status ABORTED; the lead itself is
  alive): the coordinator recovers the slice, as for a member lost while it runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ERROR_KEY = "rallypoint-error"


@dataclass(frozen=True, slots=True)
class CorruptCheckpoint:
    """The checkpoint of ``slice_name`` at ``step`` did not restore."""

    slice_name: str
    step: int


def corrupt_checkpoint_metadata(slice_name: str, step: int) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that reports a corrupt checkpoint."""
    return ((ERROR_KEY, json.dumps({"kind": "corrupt_checkpoint", "slice": slice_name, "step": int(step)})),)


@dataclass(frozen=True, slots=True)
class ProgramFailure:
    """The job's own program failed deterministically: ``part`` of it, with ``error``."""

    part: str
    error: str


def program_failed_metadata(part: str, error: str) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that reports a deterministic failure of the job's own program."""
    return ((ERROR_KEY, json.dumps({"kind": "program_failed", "part": part, "error": error})),)


@dataclass(frozen=True, slots=True)
class MemberLost:
    """A member of a multi-host slice the called worker leads was lost: the one on ``worker``, with ``error``
    (``worker`` empty: the lead's own member)."""

    worker: str
    error: str


def member_lost_metadata(worker: str, error: str) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that reports a lost member of a multi-host slice the called worker leads."""
    return ((ERROR_KEY, json.dumps({"kind": "member_lost", "worker": worker, "error": error})),)


def parse_error(metadata: Iterable[Any] | None) -> CorruptCheckpoint | ProgramFailure | MemberLost | None:
    """The typed error in a call's trailing metadata, or None (absent or not understood)."""
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key != ERROR_KEY:
            continue
        try:
            d = json.loads(value)
        except (TypeError, ValueError):
            return None
        if isinstance(d, dict) and d.get("kind") == "corrupt_checkpoint":
            try:
                return CorruptCheckpoint(str(d["slice"]), int(d["step"]))
            except (KeyError, TypeError, ValueError):
                return None
        if isinstance(d, dict) and d.get("kind") == "program_failed":
            part, error = d.get("part"), d.get("error")
            return ProgramFailure(part, error) if isinstance(part, str) and isinstance(error, str) else None
        if isinstance(d, dict) and d.get("kind") == "member_lost":
            worker, error = d.get("worker"), d.get("error")
            return MemberLost(worker, error) if isinstance(worker, str) and isinstance(error, str) else None
    return None
