"""The coordination store's interface: our own small interface over etcd, and its plain types.

The rest of Rallypoint speaks to etcd only through :class:`Store` (get, put, txn,
watch-from-revision, leases), so it does not depend on one client library and
tests reach the real server through the same calls as production. This module holds
the protocol, the records it reads and writes (:class:`KeyValue`, :class:`Compare` and
its guards, :class:`Put`, :class:`Delete`, :class:`Get`, :class:`TxnResult`, watch
batches, lease grants) and :func:`prefix_end`; no client library.
:class:`~rallypoint.etcd.etcd_store.EtcdStore` implements it over a real etcd
(``tests/fakes.py`` has an in-memory one).

etcd facts this interface encodes:

- A write that times out or loses its connection is *indeterminate*: it may have
  applied. Such failures raise :class:`~rallypoint.basics.errors.WriteIndeterminate`;
  callers make writes idempotent with a compare and re-read on retry.
- A watch resumes from the last revision seen + 1, and fails once that revision
  is compacted: :class:`~rallypoint.basics.errors.WatchCompacted`.
- Revisions are totally ordered; the create revision of a key is a fencing token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

# ---------------------------------------------------------------------------
# Plain data


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd stores it."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    def json(self) -> Any:
        """The value decoded as JSON."""
        return json.loads(self.value)


CompareTarget = Literal["version", "create", "mod", "value", "lease"]
CompareOp = Literal["==", "!=", "<", ">"]


MAX_TXN_OPS = 128
"""etcd refuses a transaction with more compares, or more operations, than this (its default ``--max-txn-ops``)."""
TXN_OPS = 100
"""How many a transaction of ours that may be split carries: room for the guards a fenced write adds."""


@dataclass(frozen=True, slots=True)
class Compare:
    """A transaction guard: ``target(key) op value``."""

    key: str
    target: CompareTarget
    op: CompareOp
    value: int | bytes | str


def key_missing(key: str) -> Compare:
    """Guard: ``key`` does not exist."""
    return Compare(key, "version", "==", 0)


def key_exists(key: str) -> Compare:
    """Guard: ``key`` exists."""
    return Compare(key, "version", ">", 0)


def created_at(key: str, revision: int) -> Compare:
    """Guard: ``key`` exists and was created at ``revision`` (same incarnation/term)."""
    return Compare(key, "create", "==", revision)


def unchanged_since(key: str, mod_revision: int) -> Compare:
    """Guard: ``key`` was last written at ``mod_revision``."""
    return Compare(key, "mod", "==", mod_revision)


@dataclass(frozen=True, slots=True)
class Put:
    """Write ``value`` at ``key``, attached to etcd lease ``lease`` when given."""

    key: str
    value: bytes | str
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    """Delete ``key`` (or every key under it when ``prefix``)."""

    key: str
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Get:
    """Read ``key`` (or every key under it when ``prefix``) inside a transaction."""

    key: str
    prefix: bool = False


Op = Put | Delete | Get


@dataclass(frozen=True, slots=True)
class TxnResult:
    """Outcome of a transaction: which branch ran, at what revision, and its reads."""

    succeeded: bool
    revision: int
    reads: list[list[KeyValue]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change to one key. ``prev`` is the value before it, when etcd still had it."""

    type: Literal["put", "delete"]
    kv: KeyValue
    prev: KeyValue | None


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """Events delivered together, all at revisions <= ``revision``."""

    revision: int
    events: list[WatchEvent]


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A granted etcd lease. ``ttl_s`` may exceed the request: etcd raises it to its minimum."""

    id: int
    ttl_s: int


class Watch(Protocol):
    """An open watch: iterate for batches, ``cancel()`` to stop."""

    def __iter__(self) -> Iterator[WatchBatch]: ...

    def cancel(self) -> None: ...


class Store(Protocol):
    """What Rallypoint needs from its coordination store."""

    def get(self, key: str) -> KeyValue | None: ...

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]: ...

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int: ...

    def delete(self, key: str, prefix: bool = False) -> int: ...

    def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult: ...

    def grant_lease(self, ttl_s: int) -> LeaseGrant: ...

    def keepalive(self, lease_id: int) -> int: ...

    def revoke_lease(self, lease_id: int) -> None: ...

    def lease_ttl(self, lease_id: int) -> int: ...

    def watch_prefix(self, prefix: str, start_revision: int) -> Watch: ...

    def compact(self, revision: int) -> None: ...

    def close(self) -> None: ...


def prefix_end(prefix: bytes) -> bytes:
    """The etcd ``range_end`` covering every key that starts with ``prefix``."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"
