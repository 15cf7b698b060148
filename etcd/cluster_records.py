"""What the cluster looks like in etcd, as plain records (no I/O here).

:class:`WorkerInfo` is one registered worker incarnation; :class:`ClusterSnapshot`
every live worker with its devices, their holders, cordons and recorded losses, as
:func:`rallypoint.etcd.cluster_view.read_cluster` reads them at one revision. The
planners in ``rallypoint.recovery`` take these as plain data.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from rallypoint.etcd.records import REQUIRED, Fields


class _Record(Protocol):
    """An etcd key-value as the records need it (``rallypoint.etcd.store.KeyValue``)."""

    key: str
    value: bytes
    create_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A registered worker incarnation as its etcd record describes it."""

    worker: str
    incarnation: int
    lease: int
    address: str
    pid: int
    devices: int
    state: str
    record: dict[str, Any]
    data_address: str = ""
    platform: str = ""  # as jax.export names it (cpu, cuda, rocm, tpu); "" from a worker that did not say
    device_kind: str = ""
    device_memory_bytes: int = 0  # each device's memory limit; 0: none reported (CPU: host memory)
    deterministic: bool = True  # its kernels are deterministic (docs/platforms.md)

    @classmethod
    def from_kv(cls, worker: str, kv: _Record) -> WorkerInfo:
        """The record at ``kv`` of ``worker``.

        Raises:
            BadRecord: not a JSON object, or a field of the wrong type (:mod:`rallypoint.etcd.records`).
        """
        f = Fields(kv.key, kv.value, "worker")
        return cls(
            worker=worker,
            incarnation=kv.create_revision,
            lease=kv.lease,
            address=f.text("address"),
            data_address=f.text("data_address"),
            pid=f.integer("pid"),
            devices=f.integer("devices"),
            state=f.text("state", "serving"),
            record=f.raw,
            platform=f.text("platform"),
            device_kind=f.text("device_kind"),
            device_memory_bytes=f.integer("device_memory_bytes"),
            deterministic=f.flag("deterministic", True),
        )


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a device."""

    job: str
    slice: str
    nonce: str
    term: int = 0

    @classmethod
    def from_json(cls, raw: bytes, key: str = "leases/") -> Holder:
        """The holder record ``raw`` (at ``key``, named in errors).

        Raises:
            BadRecord: not a JSON object with string ``job`` and ``slice``.
        """
        f = Fields(key, raw, "holder")
        return cls(job=f.text("job", REQUIRED), slice=f.text("slice", REQUIRED), nonce=f.text("nonce"),
                   term=f.integer("term"))

    def to_json(self) -> str:
        return json.dumps({"job": self.job, "slice": self.slice, "nonce": self.nonce, "term": self.term, "at": time.time()})


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """One live worker with its devices, holders and cordon flag."""

    info: WorkerInfo
    devices: tuple[int, ...]
    holders: dict[int, Holder]
    cordoned: bool
    cordoned_by: str = ""  # who cordoned it, as its cordon record says ("operator", "drain", "suspect-sdc", ...)

    @property
    def free(self) -> list[int]:
        return [d for d in self.devices if d not in self.holders]

    @property
    def state(self) -> str:
        if self.info.state == "leaving":
            return "leaving"
        if self.cordoned:
            return "cordoned"
        return "leased" if self.holders else "spare"


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """Workers, devices, leases, cordons and losses, all read at one revision."""

    revision: int
    workers: dict[str, WorkerSnapshot]
    cordoned: frozenset[str]
    lost: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def spares(self) -> list[str]:
        return sorted(w for w, s in self.workers.items() if s.state == "spare")
