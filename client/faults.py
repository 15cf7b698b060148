"""``--fail 'kill:NAME@STEP'``: SIGKILL the worker holding a slice (or a node's slice) at a step.

For demos and tests. The injector follows the job's events: the placement from
``job.placed`` and every ``job.recovered`` (a slice moves when its worker is lost),
and the steps from ``step.done``. When the job has finished every step below
``STEP``, it sends SIGKILL to the process of the worker holding ``NAME``, found by
its etcd registration (pid and host; only a worker on this host can be killed).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rallypoint.etcd.errors import ConfigError
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import EtcdStore
from rallypoint.proto import rallypoint_pb2 as pb

_SPEC = re.compile(r"^kill:(?P<name>[A-Za-z0-9_.-]+)@(?P<step>\d+)$")


@dataclass(frozen=True)
class Fault:
    name: str  # as given: a slice or a node
    slice: str
    step: int


def parse_faults(specs: Iterable[str], *, slices: Sequence[str], node_slices: dict[str, str], steps: int) -> list[Fault]:
    """Parse ``kill:NAME@STEP`` specs against the program.

    Raises:
        ConfigError: a malformed spec, an unknown name, or a step outside the job.
    """
    faults = []
    for spec in specs:
        m = _SPEC.match(spec.strip())
        if not m:
            raise ConfigError(f"--fail {spec!r}: write it as kill:NAME@STEP (NAME a slice or a node, STEP a number)")
        name, step = m["name"], int(m["step"])
        if name in slices:
            slice_name = name
        elif name in node_slices:
            slice_name = node_slices[name]
        else:
            raise ConfigError(f"--fail {spec!r}: {name!r} is neither a slice ({', '.join(sorted(slices))}) nor a node "
                              "of the program")
        if not 0 < step < steps:
            raise ConfigError(f"--fail {spec!r}: the step must be between 1 and {steps - 1} (the job runs {steps} steps)")
        faults.append(Fault(name, slice_name, step))
    return faults


@dataclass
class FaultInjector:
    """Fires the faults as the job reaches their steps; call :meth:`on_event` with every job event."""

    faults: list[Fault]
    endpoints: Sequence[str]
    cluster: str
    log: Callable[[dict[str, Any]], None] = lambda _: None
    fired: list[dict[str, Any]] = field(default_factory=list)
    placement: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._pending = sorted(self.faults, key=lambda f: f.step)
        self._lock = threading.Lock()

    def on_event(self, ev: pb.JobEvent) -> None:
        if ev.event in ("job.placed", "job.recovered"):
            detail = json.loads(ev.detail or "{}")
            where = detail.get("placement", detail)
            self.placement.update({s: p["worker"] for s, p in where.items() if isinstance(p, dict) and "worker" in p})
        elif ev.event == "step.done":
            self._fire_due(int(ev.step) + 1)

    def _fire_due(self, reached: int) -> None:
        with self._lock:
            due = [f for f in self._pending if f.step <= reached]
            self._pending = [f for f in self._pending if f.step > reached]
        for f in due:
            self.fired.append(self.kill(f, reached))
            self.log(self.fired[-1])

    def kill(self, fault: Fault, reached: int) -> dict[str, Any]:
        worker = self.placement.get(fault.slice)
        record: dict[str, Any] = {"event": "fault.injected", "fault": f"kill:{fault.name}@{fault.step}",
                                  "slice": fault.slice, "worker": worker, "step": reached, "at": time.time()}
        if worker is None:
            return record | {"error": f"slice {fault.slice!r} has no known worker"}
        store = EtcdStore(self.endpoints)
        try:
            kv = store.get(Keys(self.cluster).worker(worker))
        finally:
            store.close()
        if kv is None:
            return record | {"error": f"worker {worker} is not registered"}
        info = kv.json()
        if info.get("host") != socket.gethostname():
            return record | {"error": f"worker {worker} runs on {info.get('host')}, not this host"}
        pid = int(info["pid"])
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return record | {"pid": pid, "error": "no such process"}
        return record | {"pid": pid, "signal": "SIGKILL"}
