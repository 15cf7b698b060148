"""The one boundary where a record read from etcd becomes a typed value, or is refused.

Every reader of a prefix (workers, devices, leases, cordons, losses, drains, commits, job
records, holders, yields, metrics targets) parses each key-value through this module: a
value that is not what its writer writes (not JSON, not a JSON object, a field of the wrong
type, a key whose segments do not parse) raises :class:`BadRecord` from the parse, and the
reader skips it through :func:`skip_bad`: the record is logged (``record.bad``, with its key,
kind and what is wrong), counted by kind, and left out of what the reader returns. Nothing
deeper sees it, so no thread of the coordinator or of a worker can die of one bad key
(a worker with write access to etcd, or a bit flipped on the way, cannot stop the leader).

The counts are process-wide (:func:`bad_record_counts`); the coordinator's and the
worker's Prometheus endpoints export them as ``rallypoint_bad_records_total{kind}``.
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from rallypoint.basics.logs import get_logger

MAX_RECORD_BYTES = 1 << 21
"""The largest record parsed (2 MiB, over etcd's default 1.5 MiB request limit): a bigger value is refused unread."""

T = TypeVar("T")


class BadRecord(ValueError):
    """A record in etcd that is not what its writer writes; the reader skips it (see the module doc)."""

    def __init__(self, key: str, kind: str, why: str) -> None:
        super().__init__(f"{kind} record at {key!r} is malformed: {why}; it is skipped (delete or rewrite the key)")
        self.key, self.kind, self.why = key, kind, why


class _KV(Protocol):
    key: str
    value: bytes


_counts: Counter[str] = Counter()
_lock = threading.Lock()
_log = get_logger("rallypoint.records")


def report(exc: BadRecord) -> None:
    """Log and count one skipped record."""
    with _lock:
        _counts[exc.kind] += 1
    _log.warning("record.bad", key=exc.key, kind=exc.kind, error=exc.why)


def bad_record_counts() -> dict[str, int]:
    """Records skipped in this process so far, by kind."""
    with _lock:
        return dict(_counts)


def bad_records_metric() -> Any:
    """``rallypoint_bad_records_total{kind}``: the records this process skipped (for a Prometheus collector)."""
    from prometheus_client.core import CounterMetricFamily

    c = CounterMetricFamily("rallypoint_bad_records", "Records read from etcd that were malformed, logged "
                            "(record.bad) and skipped, by kind (rallypoint.etcd.records)", labels=["kind"])
    for kind, n in sorted(bad_record_counts().items()):
        c.add_metric([kind], float(n))
    return c


def skip_bad(parse: Callable[[], T]) -> T | None:
    """``parse()``, or None when it raises :class:`BadRecord` (which is then reported)."""
    try:
        return parse()
    except BadRecord as exc:
        report(exc)
        return None


def parsed(kv: _KV | None, kind: str) -> dict[str, Any] | None:
    """The JSON object at ``kv``; None when there is no key or its record is malformed (reported)."""
    if kv is None:
        return None
    return skip_bad(lambda: Fields.of(kv, kind).raw)


def json_value(key: str, value: bytes | str, kind: str) -> Any:
    """The JSON in ``value`` (any JSON), or :class:`BadRecord`."""
    if len(value) > MAX_RECORD_BYTES:
        raise BadRecord(key, kind, f"{len(value)} bytes is over the limit of {MAX_RECORD_BYTES}")
    try:
        return json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRecord(key, kind, f"not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None


class Fields:
    """A record that must be a JSON object, with typed reads of its fields (each raises :class:`BadRecord`).

    Args:
        key: the record's key (named in errors).
        value: its bytes, or an object already decoded (a commit's on-disk copy, an event's detail).
        kind: what it is (``worker``, ``holder``, ``commit``...): the label of the count.
    """

    def __init__(self, key: str, value: bytes | str | Mapping[str, Any], kind: str) -> None:
        self.key, self.kind = key, kind
        raw = value if isinstance(value, Mapping) else json_value(key, value, kind)
        if not isinstance(raw, dict):
            raise BadRecord(key, kind, f"a JSON {type(raw).__name__}, not an object")
        self.raw: dict[str, Any] = raw

    @classmethod
    def of(cls, kv: _KV, kind: str) -> Fields:
        return cls(kv.key, kv.value, kind)

    def bad(self, name: str, why: str) -> BadRecord:
        return BadRecord(self.key, self.kind, f"field {name!r} {why}")

    def _get(self, name: str, default: Any) -> Any:
        if name not in self.raw:
            if default is _REQUIRED:
                raise self.bad(name, "is missing")
            return default
        return self.raw[name]

    def text(self, name: str, default: Any = "") -> str:
        v = self._get(name, default)
        if not isinstance(v, str):
            raise self.bad(name, f"is {type(v).__name__} {_short(v)}, not a string")
        return v

    def integer(self, name: str, default: Any = 0) -> int:
        v = self._get(name, default)
        if v is None and default is not _REQUIRED:
            return int(default or 0)
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise self.bad(name, f"is {type(v).__name__} {_short(v)}, not an integer")
        try:
            out = int(v)
        except (ValueError, OverflowError):
            raise self.bad(name, f"is {_short(v)}, not an integer") from None
        if isinstance(v, float) and out != v:
            raise self.bad(name, f"is {v}, not an integer")
        return out

    def number(self, name: str, default: Any = 0.0) -> float:
        v = self._get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.bad(name, f"is {type(v).__name__} {_short(v)}, not a number")
        out = float(v)
        if not math.isfinite(out):
            raise self.bad(name, f"is {out}, not a finite number")
        return out

    def flag(self, name: str, default: Any = False) -> bool:
        v = self._get(name, default)
        if v is None and default is not _REQUIRED:
            return bool(default)
        if not isinstance(v, bool):
            raise self.bad(name, f"is {type(v).__name__} {_short(v)}, not true or false")
        return v

    def obj(self, name: str, default: Any = None) -> dict[str, Any]:
        v = self._get(name, {} if default is None else default)
        if not isinstance(v, dict):
            raise self.bad(name, f"is {type(v).__name__}, not an object")
        return v

    def items(self, name: str, default: Any = None) -> list[Any]:
        v = self._get(name, [] if default is None else default)
        if not isinstance(v, list):
            raise self.bad(name, f"is {type(v).__name__}, not a list")
        return v


_REQUIRED: Any = object()
REQUIRED: Any = _REQUIRED
"""The default that makes a field required: ``Fields.text("job", REQUIRED)``."""


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def key_parts(key: str, under: str, n: int, kind: str) -> list[str]:
    """The ``n`` non-empty segments of ``key`` below ``under``, or :class:`BadRecord`."""
    if not key.startswith(under):
        raise BadRecord(key, kind, f"its key is not under {under!r}")
    parts = key[len(under):].split("/")
    if len(parts) != n or not all(parts):
        raise BadRecord(key, kind, f"its key has {len(parts)} segment(s) below {under!r}, not {n} non-empty")
    return parts


def key_index(key: str, segment: str, kind: str) -> int:
    """A device index segment of a key (``devices/<w>/<index>``, ``leases/<w>/<index>``), or :class:`BadRecord`."""
    if not segment.isascii() or not segment.isdigit() or len(segment) > 9:
        raise BadRecord(key, kind, f"device index {_short(segment)} is not a small non-negative integer")
    return int(segment)
