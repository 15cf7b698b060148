"""Fault injectors: each fires one real fault on the embedded local cluster and counts it.

Every injector is a method of :class:`Injectors` named after the fault's kind (see
:data:`rallypoint.chaos.scenario.KINDS`). It fires the fault, returns a record of what it did
(the worker, pid, signal, member, path ...) and, for faults with a duration, a
``heal`` callable the scheduler runs when the duration is over. ``fired`` and
``healed`` count per kind what actually happened.

* ``kill``: SIGKILL of the worker process holding the target (a slice, a node's
  slice, or a worker by name). ``hang``: SIGSTOP, SIGCONT when healed; the worker's
  lease expires meanwhile, so the woken process is a zombie that must be refused:
  the heal records whether it came back as a new incarnation. ``straggler``: a
  stop/continue duty cycle (stopped three quarters of every 0.2 s) for the duration. The job's
  straggler watch may move the slice off it (a drain, reason ``straggler``), which
  leaves the worker cordoned; the heal takes that cordon back, as an operator would
  once the host is fixed, so the worker is a spare again (a migration that ends after
  the heal is uncordoned then: :class:`~rallypoint.chaos.follower.ScenarioFollower`).
* ``preempt``: SIGTERM of the worker holding the target, a preemption notice: it asks
  to be drained and leaves once it holds nothing (or its deadline passed).
  ``drain``: an operator's drain of that worker (as ``rallypoint drain``; refused,
  and recorded as an injection error, when no spare has room).
* ``tenant``: another holder leases free devices of the target worker (``devices`` of
  them, or all) for the duration, as another job would: a recovery or drain then finds
  less room (``on_no_spare='shrink'`` restores onto fewer devices, and grows back once
  the tenant left).
* ``partition``: the worker's network cut while its process lives
  (:mod:`rallypoint.chaos.network`: network namespaces when root, else loopback proxies).
* ``leader_kill`` / ``leader_hang``: SIGKILL / SIGSTOP of the leader coordinator.
* ``etcd_kill``: SIGKILL of one etcd member (of three; the job goes on).
  ``etcd_quorum``: SIGKILL of two members, restarted from their data when healed.
* ``corrupt_checkpoint`` / ``truncate_checkpoint``: SIGSTOP the target slice's worker
  (so it commits nothing newer), overwrite bytes in (or cut in half) the largest file
  of the slice's newest committed checkpoint, then SIGKILL the worker so that a
  recovery has to restore it, or an older cut.
* ``disk_full`` / ``disk_readonly``: the checkpoint directory fills up or turns
  read-only (:class:`rallypoint.chaos.storage.Storage`: a small tmpfs when root, else an error
  injected at the storage layer).
* ``corrupt``: silent data corruption. The workers of a scenario with a corrupt fault are started with a
  corrupt flag file (``WorkerFaults.corrupt_flag``); the injector adds a spec to it naming the worker that
  holds the target slice now, the slice (and the node, when the target is one), the fault's ``at_step``
  (0 for a fault at a time) and its ``mode``. That worker then flips one bit of the slice's state at its
  first update of a step at or past it (``once``), or at every one (``persist``): the job goes on, and
  its final state differs from the reference's (:mod:`rallypoint.workers.corruption`).
* ``suspend``: an operator's suspend of the whole job (``SuspendJob``, as ``rallypoint
  suspend``; refused, and recorded as an injection error, when the leader refuses it). The job
  saves at its next step boundary (after a recovery under way) and ends SUSPENDED; the harness
  then resumes it (:meth:`~rallypoint.chaos.follower.ScenarioFollower.follow`, ``resume_after_s``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rallypoint.basics.clock import SYSTEM_CLOCK
from rallypoint.basics.retry import retrying
from rallypoint.chaos.scenario import FaultSpec
from rallypoint.etcd.commits import read_commits, read_worker_commits
from rallypoint.basics.errors import RallypointError
from rallypoint.cluster.local import LocalCluster

Heal = Callable[[], dict[str, Any]]


class InjectionError(RallypointError):
    """A fault could not be fired (its target is unknown or already gone)."""


def newest_commit(store: Any, keys: Any, job: str, slice_name: str, worker: str) -> Any:
    """The newest checkpoint of ``slice_name`` in etcd: promoted, or only at ``worker``'s own keys.

    The worker's own commit is in etcd before the leader hears of it; the leader's promotion can land
    seconds later on a loaded host, so a choice among promoted commits alone could damage an older
    checkpoint than the one a recovery then restores."""
    commits = [*read_commits(store, keys, job).get(slice_name, []),
               *read_worker_commits(store, keys, worker, job).get(slice_name, [])]
    if not commits:
        raise InjectionError(f"slice {slice_name!r} has no committed checkpoint yet")
    return max(commits, key=lambda c: c.step)


@dataclass
class Target:
    """What the injectors act on: the cluster, the job's placement, and the optional controls."""

    lc: LocalCluster
    job: str
    node_slice: dict[str, str]
    placement: dict[str, str] = field(default_factory=dict)  # slice -> worker, kept current from job events
    members: dict[str, list[str]] = field(default_factory=dict)  # multi-host slice -> its members' workers, in order
    network: Any = None  # chaos.network partition control, when the scenario partitions
    storage: Any = None  # chaos.storage.Storage, when the scenario fills or freezes the disk
    corrupt_flag: Path | None = None  # the workers' corrupt flag file, when the scenario corrupts

    def worker_of(self, target: str) -> str:
        slice_name, _, k = target.partition("#")  # SLICE#K: member K of a multi-host slice (docs/multihost.md)
        if k:
            members = self.members.get(slice_name, [])
            if not k.isdigit() or int(k) >= len(members):
                raise InjectionError(f"fault target {target!r}: slice {slice_name!r} has no member {k} "
                                     f"(members: {members})")
            return members[int(k)]
        if target in self.placement:
            return self.placement[target]
        if target in self.node_slice and self.node_slice[target] in self.placement:
            return self.placement[self.node_slice[target]]
        if any(p.name == target and p.role == "worker" for p in self.lc.processes):
            return target
        raise InjectionError(f"fault target {target!r} is neither a placed slice, a node nor a worker "
                             f"(placement: {self.placement})")

    def slice_of(self, target: str) -> str:
        if target in self.placement:
            return target
        if target in self.node_slice:
            return self.node_slice[target]
        by_worker = [s for s, w in self.placement.items() if w == target]
        if by_worker:
            return sorted(by_worker)[0]
        raise InjectionError(f"fault target {target!r} names no slice of the job")

    def leader(self) -> str:
        store = self.lc.store()
        try:
            kv = store.get(self.lc.keys.leader)
        finally:
            store.close()
        if kv is None:
            raise InjectionError("the cluster has no leader coordinator right now")
        return str(kv.json()["coordinator"])

    def incarnation(self, worker: str) -> int | None:
        """The worker's incarnation now (None: not registered); an etcd that does not answer at once (a loaded
        host: the harness's own connection timing out) is asked again for up to 10 s, not an injection error."""
        def once() -> int | None:
            store = self.lc.store()
            try:
                kv = store.get(self.lc.keys.worker(worker))
            finally:
                store.close()
            return None if kv is None else kv.create_revision

        return retrying(clock=SYSTEM_CLOCK, what=f"reading worker {worker}", stop_after_s=10.0, max_s=0.5)(once)


TENANT_JOB = "chaos-tenant"  # the holder name of the devices a tenant fault takes
SETTLE_S = 0.3  # a frozen worker's commit already sent lands in etcd within this (damaged checkpoints)
# A straggler's duty cycle: stopped this long of every period. Three quarters: with the suite's warm compilation
# cache the pipeline's steps take ~0.06 s, and a stage stopped half the time was within the policy's noise on a
# loaded 2-core host (the watch then never judged it a straggler in one CI run).
STRAGGLER_STOP_S, STRAGGLER_PERIOD_S = 0.15, 0.2


class Injectors:
    """Fires faults on a :class:`Target`; ``fired`` / ``healed`` count them per kind."""

    def __init__(self, target: Target) -> None:
        self.t = target
        self.fired: Counter[str] = Counter()
        self._struck: float | None = None  # when the fault being fired took effect (wall clock)
        self.healed: Counter[str] = Counter()
        self.straggling: set[str] = set()  # workers a straggler fault slows now
        self.straggled: set[str] = set()  # workers whose straggler fault healed

    def fire(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        """Fire one fault. Raises :class:`InjectionError` when it cannot be fired."""
        fn = getattr(self, spec.kind, None)
        if fn is None:
            raise InjectionError(f"no injector for fault kind {spec.kind!r}")
        self._struck = None
        detail, heal = fn(spec)
        if self._struck is not None:  # the fault took effect here (the target was looked up before)
            detail["struck_at"] = self._struck
        self.fired[spec.kind] += 1
        if heal is None:
            return detail, None

        def counted() -> dict[str, Any]:
            out = heal()
            self.healed[spec.kind] += 1
            return out

        return detail, counted

    # -- workers ----------------------------------------------------------------------------

    def _signal(self, name: str, sig: int) -> int:
        rec = self.t.lc.process(name)
        os.kill(rec.pid, sig)
        self._struck = time.time()
        return rec.pid

    def kill(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        w = self.t.worker_of(spec.target)
        return {"worker": w, "pid": self._signal(w, signal.SIGKILL), "signal": "SIGKILL"}, None

    def preempt(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        w = self.t.worker_of(spec.target)
        return {"worker": w, "pid": self._signal(w, signal.SIGTERM), "signal": "SIGTERM"}, None

    def drain(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        from rallypoint.client.commands.drains import DrainRefused, begin_drain

        w = self.t.worker_of(spec.target)
        store = self.t.lc.store()
        try:
            req, _ = begin_drain(store, self.t.lc.keys, w, by="chaos harness")
        except DrainRefused as exc:
            raise InjectionError(str(exc)) from None
        finally:
            store.close()
        return {"worker": w, "drain_revision": req.revision}, None

    def tenant(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        from rallypoint.etcd.cluster_view import read_cluster
        from rallypoint.orchestrator.control.devices import DeviceLeases

        w = self.t.worker_of(spec.target)
        holder = f"t{sum(self.fired.values())}"
        store = self.t.lc.store()
        try:
            ws = read_cluster(store, self.t.lc.keys).workers.get(w)
            free = sorted(ws.free) if ws is not None else []
            take = free[: spec.devices] if spec.devices else free
            if not take or (spec.devices and len(take) < spec.devices):
                raise InjectionError(f"worker {w} has {len(free)} free devices, the tenant wants "
                                     f"{spec.devices or 'at least one'}")
            if DeviceLeases(store, self.t.lc.keys).lease(TENANT_JOB, holder, w, take) is None:
                raise InjectionError(f"devices {take} of worker {w} were taken first")
        finally:
            store.close()

        def heal() -> dict[str, Any]:
            store = self.t.lc.store()
            try:
                return {"released": DeviceLeases(store, self.t.lc.keys).release(TENANT_JOB, holder, worker=w)}
            finally:
                store.close()

        return {"worker": w, "devices": take, "holder": f"{TENANT_JOB}/{holder}"}, heal

    def hang(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        w = self.t.worker_of(spec.target)
        incarnation = self.t.incarnation(w)
        pid = self._signal(w, signal.SIGSTOP)

        def heal() -> dict[str, Any]:
            os.kill(pid, signal.SIGCONT)
            deadline = time.monotonic() + 15
            now = self.t.incarnation(w)
            while now in (None, incarnation) and time.monotonic() < deadline:
                time.sleep(0.2)
                now = self.t.incarnation(w)
            return {"healed_with": "SIGCONT", "incarnation_before": incarnation, "incarnation_after": now,
                    "zombie_refused": now is not None and now != incarnation}

        return {"worker": w, "pid": pid, "signal": "SIGSTOP", "incarnation": incarnation}, heal

    def straggler(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        w = self.t.worker_of(spec.target)
        pid = self.t.lc.process(w).pid
        stop = threading.Event()
        cycles = [0]

        def duty() -> None:
            while not stop.is_set():
                try:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(STRAGGLER_STOP_S)
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    return
                cycles[0] += 1
                stop.wait(STRAGGLER_PERIOD_S - STRAGGLER_STOP_S)

        thread = threading.Thread(target=duty, name=f"straggler-{w}", daemon=True)
        thread.start()

        def heal() -> dict[str, Any]:
            stop.set()
            thread.join()
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.straggling.discard(w)
            self.straggled.add(w)
            return {"cycles": cycles[0], "uncordoned": self.uncordon_straggler(w)}

        self.straggling.add(w)

        return {"worker": w, "pid": pid, "duty": f"stopped {STRAGGLER_STOP_S:g} s of every {STRAGGLER_PERIOD_S:g} s"}, heal

    def uncordon_straggler(self, worker: str) -> bool:
        """The host of a healed straggler is fixed: take back the cordon a straggler migration put on it, as the
        operator would (``rallypoint uncordon``); an operator's cordon stays. Returns whether one was taken back."""
        from rallypoint.orchestrator.job.stragglers import CORDON_BY

        store = self.t.lc.store()
        try:
            kv = store.get(self.t.lc.keys.cordon(worker))
            if kv is None or kv.json().get("by") != CORDON_BY:
                return False
            return store.delete(self.t.lc.keys.cordon(worker)) > 0
        finally:
            store.close()

    def partition(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        if self.t.network is None:
            raise InjectionError("this cluster was not started partitionable (no network control)")
        w = self.t.worker_of(spec.target)
        self.t.network.partition(w)
        self._struck = time.time()

        def heal() -> dict[str, Any]:
            self.t.network.heal(w)
            return {"healed": w}

        return {"worker": w, "mode": self.t.network.mode}, heal

    # -- coordinators and etcd -------------------------------------------------------------------

    def leader_kill(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        leader = self.t.leader()
        return {"coordinator": leader, "pid": self._signal(leader, signal.SIGKILL), "signal": "SIGKILL"}, None

    def leader_hang(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        leader = self.t.leader()
        pid = self._signal(leader, signal.SIGSTOP)

        def heal() -> dict[str, Any]:
            os.kill(pid, signal.SIGCONT)
            return {"healed_with": "SIGCONT"}

        return {"coordinator": leader, "pid": pid, "signal": "SIGSTOP"}, heal

    def _etcd(self) -> Any:
        if self.t.lc.etcd is None or len(self.t.lc.etcd.members) < 3:
            raise InjectionError("etcd faults need the embedded etcd with 3 members, started by this process")
        return self.t.lc.etcd

    def etcd_kill(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        etcd = self._etcd()
        i = int(spec.target) if spec.target.isdigit() else len(etcd.members) - 1
        etcd.kill_member(i)
        return {"member": etcd.members[i].name, "signal": "SIGKILL"}, None

    def etcd_quorum(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        etcd = self._etcd()
        victims = [1, 2]
        for i in victims:
            etcd.kill_member(i)

        def heal() -> dict[str, Any]:
            for i in victims:
                etcd.start_member(i)
            return {"restarted": [etcd.members[i].name for i in victims]}

        return {"members": [etcd.members[i].name for i in victims], "signal": "SIGKILL"}, heal

    # -- storage ---------------------------------------------------------------------------------

    def _newest_commit(self, slice_name: str, worker: str) -> Any:
        store = self.t.lc.store()
        try:
            return newest_commit(store, self.t.lc.keys, self.t.job, slice_name, worker)
        finally:
            store.close()

    def _damage(self, spec: FaultSpec, how: str) -> tuple[dict[str, Any], Heal | None]:
        s = self.t.slice_of(spec.target)
        w = self.t.worker_of(s)
        # Freeze the worker first, so the checkpoint damaged is its slice's newest for good: a save that
        # commits between the choice and the kill would give the recovery a newer, intact cut. The pause
        # lets the worker's own commit already on its way to etcd land; it is far under the lease TTL, so
        # nobody is lost yet. The leader's promotion of it may come later: _newest_commit reads both.
        pid = self._signal(w, signal.SIGSTOP)
        time.sleep(SETTLE_S)
        try:
            c = self._newest_commit(s, w)
            files = [p for p in Path(c.path).rglob("*") if p.is_file()]
            if not files:
                raise InjectionError(f"the checkpoint at {c.path} has no files")
        except InjectionError:
            os.kill(pid, signal.SIGCONT)
            raise
        f = max(files, key=lambda p: p.stat().st_size)
        data = bytearray(f.read_bytes())
        if how == "corrupt":
            mid = len(data) // 2
            data[mid: mid + 64] = bytes(b ^ 0xFF for b in data[mid: mid + 64])
        else:
            data = data[: len(data) // 2]
        f.write_bytes(bytes(data))
        self._signal(w, signal.SIGKILL)  # a recovery now has to restore it (or an older cut)
        return {"slice": s, "step": c.step, "file": str(f), "how": how, "worker": w, "pid": pid}, None

    def corrupt_checkpoint(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        return self._damage(spec, "corrupt")

    def truncate_checkpoint(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        return self._damage(spec, "truncate")

    def _storage(self) -> Any:
        if self.t.storage is None:
            raise InjectionError("this cluster's checkpoint directory is not under storage control")
        return self.t.storage

    def disk_full(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        st = self._storage()
        detail = st.fill()
        return detail, st.unfill

    def disk_readonly(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        st = self._storage()
        detail = st.freeze()
        return detail, st.thaw

    # -- silent data corruption -------------------------------------------------------------------

    def corrupt(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        from rallypoint.workers.corruption import CorruptSpec, read_specs, write_specs

        flag = self.t.corrupt_flag
        if flag is None:
            raise InjectionError("this cluster's workers were started without a corrupt flag (no corrupt hook)")
        s = self.t.slice_of(spec.target)
        w = self.t.worker_of(s)
        armed = CorruptSpec(s, spec.at_step or 0, spec.mode or "persist", worker=w,
                            node=spec.target if spec.target in self.t.node_slice else "")
        write_specs(flag, [*read_specs(flag), armed])
        self._struck = time.time()
        return {"worker": w, "slice": s, "node": armed.node, "step": armed.step, "mode": armed.mode,
                "flag": str(flag)}, None

    # -- the operator ----------------------------------------------------------------------------

    def suspend(self, spec: FaultSpec) -> tuple[dict[str, Any], Heal | None]:
        from rallypoint.client.lifecycle import control
        from rallypoint.client.submission import JobError

        try:
            reply = control(self.t.job, "suspend", endpoints=self.t.lc.endpoints, cluster=self.t.lc.keys.cluster,
                            by="chaos", reason=f"chaos harness: {spec.describe()}")
        except JobError as exc:
            raise InjectionError(str(exc)) from None
        return {"state_when_asked": reply.state, "run": reply.run, "message": reply.message,
                "resume_after_s": spec.resume_after_s}, None
