"""``--fail 'ACTION:NAME@STEP'``: act on the worker holding a slice (or a node's slice) at a step.

For demos and tests. ``ACTION`` is ``kill`` (SIGKILL: the worker is lost),
``preempt`` (SIGTERM: a preemption notice, the worker asks to be drained),
``drain`` (an operator's drain request, as ``rallypoint drain`` makes), or ``corrupt`` /
``corrupt-once`` (silent data corruption: the worker holding the slice flips one bit of the
slice's state at every state update from ``STEP`` on, or once at ``STEP``;
:mod:`rallypoint.workers.corruption`). The injector
follows the job's events: the placement from ``job.placed`` and every
``job.recovered`` or ``job.drained`` (a slice moves), and the steps from
``step.done``. When the job has finished every step below ``STEP``, it acts on the
worker holding ``NAME``, found by its etcd registration (pid and host; only a worker
on this host can be signalled).

A corrupt fault needs workers started with the hidden ``--fault-corrupt-flag`` (the embedded
cluster's, when ``--fail`` names one). Its spec (the slice, the node when ``NAME`` is one, ``STEP``)
is written to that flag file before the job is submitted, so the worker corrupts the update of step
``STEP`` itself however fast the job runs, and written again naming the slice's worker as soon as
the placement says which it is. If the slice moves before the job reaches ``STEP``, the spec is
written again for its new worker; from ``STEP`` on it stays with the worker it named (a faulty host
stays faulty; the slice's next worker computes right).
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
from pathlib import Path
from typing import Any

from rallypoint.etcd.records import parsed
from rallypoint.client.commands.drains import DrainRefused, begin_drain
from rallypoint.basics.clock import SYSTEM_CLOCK
from rallypoint.basics.errors import ConfigError
from rallypoint.etcd.keys import Keys
from rallypoint.basics.retry import retrying
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.store import Store
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.corruption import CorruptSpec, write_specs

ACTIONS = {"kill": signal.SIGKILL, "preempt": signal.SIGTERM, "drain": None, "corrupt": None, "corrupt-once": None}
CORRUPT_MODES = {"corrupt": "persist", "corrupt-once": "once"}  # a corrupt action -> its spec's mode
_SPEC = re.compile(r"^(?P<action>[a-z-]+):(?P<name>[A-Za-z0-9_.-]+)@(?P<step>\d+)$")


@dataclass(frozen=True)
class Fault:
    name: str  # as given: a slice or a node
    slice: str
    step: int
    action: str = "kill"  # one of ACTIONS

    @property
    def corrupts(self) -> bool:
        return self.action in CORRUPT_MODES


def parse_faults(specs: Iterable[str], *, slices: Sequence[str], node_slices: dict[str, str], steps: int) -> list[Fault]:
    """Parse ``ACTION:NAME@STEP`` specs against the program.

    Raises:
        ConfigError: a malformed spec, an unknown name, or a step outside the job.
    """
    faults = []
    for spec in specs:
        m = _SPEC.match(spec.strip())
        if not m or m["action"] not in ACTIONS:
            raise ConfigError(f"--fail {spec!r}: write it as ACTION:NAME@STEP (ACTION one of {', '.join(ACTIONS)}, "
                              "NAME a slice or a node, STEP a number)")
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
        faults.append(Fault(name, slice_name, step, m["action"]))
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
    connect: Callable[[Sequence[str]], Store] = EtcdStore  # a fresh etcd connection per fault (tests pass their own)
    corrupt_flag: str = ""  # the workers' --fault-corrupt-flag file ("": they have none, a corrupt fault fails)

    def __post_init__(self) -> None:
        self._pending = sorted((f for f in self.faults if not f.corrupts), key=lambda f: f.step)
        self._corrupt = [f for f in self.faults if f.corrupts]
        self._armed: dict[Fault, str] = {}  # corrupt fault -> the worker its spec names
        self._reached = 0  # every step below it is done
        self._lock = threading.Lock()
        if self._corrupt and self.corrupt_flag:  # before the job runs: its first steps may outrun job.placed
            try:
                self._write_specs()
            except OSError:
                pass  # reported when the job is placed, where writing again fails the same way

    def _write_specs(self) -> None:
        """The corrupt faults' specs, each naming the worker it was armed on (none yet: any that holds its slice)."""
        write_specs(Path(self.corrupt_flag), [
            CorruptSpec(f.slice, f.step, CORRUPT_MODES[f.action], worker=self._armed.get(f, ""),
                        node="" if f.name == f.slice else f.name) for f in self._corrupt])

    def on_event(self, ev: pb.JobEvent) -> None:
        if ev.event in ("job.placed", "job.recovered", "job.drained"):
            detail = json.loads(ev.detail or "{}")
            where = detail.get("placement", detail)
            self.placement.update({s: p["worker"] for s, p in where.items() if isinstance(p, dict) and "worker" in p})
            if self._corrupt:
                self._arm()
        elif ev.event == "step.done":
            self._fire_due(int(ev.step) + 1)

    def _arm(self) -> None:
        """Write the corrupt faults' specs for the slices' workers now (again for a slice that moved before its
        step; never for one whose step the job reached)."""
        with self._lock:
            moved = [f for f in self._corrupt if self.placement.get(f.slice) not in (None, self._armed.get(f))
                     and (f not in self._armed or f.step > self._reached)]
            if not moved:
                return
            self._armed.update({f: self.placement[f.slice] for f in moved})
            error = None
            if not self.corrupt_flag:
                error = "the workers were started without a corrupt flag (--fault-corrupt-flag): nothing can arm them"
            else:
                try:
                    self._write_specs()
                except OSError as exc:
                    error = f"writing {self.corrupt_flag}: {exc}"
        for f in moved:
            record: dict[str, Any] = {"event": "fault.injected", "fault": f"{f.action}:{f.name}@{f.step}",
                                      "slice": f.slice, "worker": self._armed[f], "step": f.step,
                                      "mode": CORRUPT_MODES[f.action], "at": time.time()}
            self.fired.append(record | ({"error": error} if error else {"armed": True}))
            self.log(self.fired[-1])

    def _fire_due(self, reached: int) -> None:
        with self._lock:
            self._reached = max(self._reached, reached)
            due = [f for f in self._pending if f.step <= reached]
            self._pending = [f for f in self._pending if f.step > reached]
        for f in due:
            self.fired.append(self.kill(f, reached))
            self.log(self.fired[-1])

    def kill(self, fault: Fault, reached: int) -> dict[str, Any]:
        worker = self.placement.get(fault.slice)
        record: dict[str, Any] = {"event": "fault.injected", "fault": f"{fault.action}:{fault.name}@{fault.step}",
                                  "slice": fault.slice, "worker": worker, "step": reached, "at": time.time()}
        if worker is None:
            return record | {"error": f"slice {fault.slice!r} has no known worker"}
        store = self.connect(self.endpoints)
        keys = Keys(self.cluster)
        # A fresh connection to etcd can fail its first call on a loaded host (a TLS handshake cut short): each
        # call is retried for up to 10 s. Both are safe to repeat: a read, and a drain request (cordon and request
        # again leave the same keys; a worker already cordoned is not cordoned twice).
        again = retrying(clock=SYSTEM_CLOCK, what=f"reaching etcd to {fault.action} worker {worker}",
                         stop_after_s=10.0)
        try:
            if fault.action == "drain":
                try:
                    req, _ = again(begin_drain, store, keys, worker, by="fault injector")
                except DrainRefused as exc:
                    return record | {"error": str(exc)}
                return record | {"drain_revision": req.revision}
            kv = again(store.get, keys.worker(worker))
        finally:
            store.close()
        if kv is None:
            return record | {"error": f"worker {worker} is not registered"}
        info = parsed(kv, "worker")
        if info is None:
            return record | {"error": f"the record of worker {worker} in etcd is malformed (logged as record.bad)"}
        if info.get("host") != socket.gethostname():
            return record | {"error": f"worker {worker} runs on {info.get('host')}, not this host"}
        pid = int(info["pid"])
        sig = ACTIONS[fault.action]
        assert sig is not None
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return record | {"pid": pid, "error": "no such process"}
        return record | {"pid": pid, "signal": signal.Signals(sig).name}
