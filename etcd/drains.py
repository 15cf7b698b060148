"""Drain requests and their results in etcd: how an operator or a preempted worker asks
the leader to move a worker's slices elsewhere, and how the leader answers.

``drain/<worker>`` holds one request (:class:`DrainRequest`): who asked, why
(``operator`` or ``preempted``), and by when the worker must be free. The operator's
request is a plain key (``rallypoint drain`` deletes it once the worker is free); a
preempted worker puts its own on its etcd lease, so it goes when the worker does. The
leader's executor of every job that holds a slice on the worker drains its slices and
answers in ``drained/<worker>/<job>`` (:class:`DrainResult`), each answer naming the
request's revision, so an answer to an older request is never read as this one's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from rallypoint.etcd.keys import Keys
from rallypoint.etcd.records import REQUIRED, Fields, key_parts, skip_bad
from rallypoint.etcd.store import KeyValue, Store

REASONS = ("operator", "preempted")


@dataclass(frozen=True)
class DrainRequest:
    worker: str
    reason: str  # one of REASONS
    by: str
    at: float  # wall clock of the request
    deadline_s: float  # the worker must be free this long after ``at`` (0: no deadline)
    revision: int = 0  # the request key's mod revision: what results name

    def to_json(self) -> str:
        return json.dumps({"reason": self.reason, "by": self.by, "at": self.at, "deadline_s": self.deadline_s})


@dataclass(frozen=True)
class DrainResult:
    job: str
    state: str  # "done" or "cancelled"
    request_revision: int
    reason: str = ""
    record: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"job": self.job, "state": self.state, "request_revision": self.request_revision,
                           "reason": self.reason, "record": self.record})

    @classmethod
    def from_json(cls, raw: Any, key: str = "drained/") -> DrainResult:
        """Raises :class:`~rallypoint.etcd.records.BadRecord` for a record that is not a drain result."""
        f = Fields(key, raw, "drain_result")
        return cls(job=f.text("job", REQUIRED), state=f.text("state", REQUIRED),
                   request_revision=f.integer("request_revision", REQUIRED), reason=f.text("reason"),
                   record=f.obj("record"))


def request_drain(store: Store, keys: Keys, worker: str, *, reason: str, by: str, deadline_s: float = 0.0,
                  lease: int = 0) -> DrainRequest:
    """Put a drain request for ``worker`` (replacing an older one); returns it with its revision."""
    if reason not in REASONS:
        raise ValueError(f"drain reason {reason!r} is not one of {list(REASONS)}")
    req = DrainRequest(worker, reason, by, time.time(), float(deadline_s))
    rev = store.put(keys.drain(worker), req.to_json(), lease=lease)
    return DrainRequest(worker, reason, by, req.at, req.deadline_s, revision=rev)


def read_drain_requests(store: Store, keys: Keys) -> dict[str, DrainRequest]:
    """Every pending drain request, by worker."""
    kvs, _rev = store.get_prefix(keys.drains)
    out = {}
    for kv in kvs:
        req = skip_bad(lambda kv=kv: _request(kv, keys))
        if req is not None:
            out[req.worker] = req
    return out


def _request(kv: KeyValue, keys: Keys) -> DrainRequest:
    worker = key_parts(kv.key, keys.drains, 1, "drain")[0]
    f = Fields.of(kv, "drain")
    reason = f.text("reason", "operator")
    if reason not in REASONS:
        raise f.bad("reason", f"is {reason!r}, not one of {list(REASONS)}")
    return DrainRequest(worker, reason, f.text("by"), f.number("at"), f.number("deadline_s"), revision=kv.mod_revision)


def read_drain_results(store: Store, keys: Keys, worker: str, request_revision: int) -> dict[str, DrainResult]:
    """The leaders' answers to the request of ``request_revision``, by job."""
    kvs, _rev = store.get_prefix(keys.drain_results(worker))
    results = (skip_bad(lambda kv=kv: DrainResult.from_json(kv.value, kv.key)) for kv in kvs)
    return {r.job: r for r in results if r is not None and r.request_revision == request_revision}
