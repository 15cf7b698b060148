"""Invariant checks over what a run left behind: plain data in, violations out.

These functions never talk to etcd; callers record the evidence (watch history,
final state) and pass it in, so the checks are tested on synthetic histories too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from orchestrator.store import WatchEvent


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant, with its evidence."""

    invariant: str
    key: str
    revision: int
    detail: str


def check_exclusive_device_leases(events: Iterable[WatchEvent]) -> list[Violation]:
    """No physical device is ever leased to two holders at once.

    ``events`` is the watch history of the ``leases/`` prefix, in revision order.
    A lease key may only be created when absent (version 1) and deleted while
    present; a put over an existing lease (version > 1) hands a held device to
    someone else without releasing it first.
    """
    held: dict[str, bytes] = {}
    violations: list[Violation] = []
    for ev in events:
        key = ev.kv.key
        if ev.type == "put":
            if key in held or ev.kv.version != 1:
                violations.append(Violation(
                    "exclusive-device-lease", key, ev.kv.mod_revision,
                    f"device leased while held: previous holder {held.get(key, b'?')!r}, new holder {ev.kv.value!r}",
                ))
            held[key] = ev.kv.value
        else:
            held.pop(key, None)
    return violations
