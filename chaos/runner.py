"""Running a chaos scenario: the job under real faults, the evidence, the invariants, the report.

:func:`run_scenario` starts an embedded local cluster as the scenario describes
(partitionable when it partitions, with a controlled checkpoint directory when it
fills or freezes the disk), records the etcd watch history of device leases,
submits the job and follows it to its end (:class:`~rallypoint.chaos.follower.ScenarioFollower`:
through leader losses, and through the scenario's own suspends, each resumed after
``resume_after_s``) while the :class:`~rallypoint.chaos.scheduler.FaultScheduler` fires the
scheduled faults as the job reaches their steps or times, then checks the invariants of
:mod:`rallypoint.chaos.invariants` against a fault-free run of the same job (the in-process
reference, bitwise equal to a fault-free cluster run) and writes the report
(:mod:`rallypoint.chaos.report`).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from rallypoint.chaos.follower import ScenarioFollower, leases_of
from rallypoint.chaos.injectors import Injectors, Target
from rallypoint.chaos.invariants import (Check, NodeInfo, check_applied_once, check_checkpoints, check_digest,
                              check_lease_history, check_outcome, check_suspends)
from rallypoint.chaos.report import LIBRARY_LOG_FILE, write_report
from rallypoint.chaos.scenario import Scenario
from rallypoint.chaos.scheduler import FaultScheduler
from rallypoint.chaos.storage import Storage
from rallypoint.etcd.commits import read_commits
from rallypoint.basics.errors import RallypointError, StoreError, WatchCompacted
from rallypoint.basics.logs import library_logs_to
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.store import WatchEvent
from rallypoint.workers.checkpoints.restore import restore_commit
from rallypoint.workers.errors import CheckpointCorrupt
from rallypoint.workers.faults import NO_FAULTS
from rallypoint.workers.runtime.records import read_records


class LeaseHistory:
    """Every change under ``leases/`` from now on, recorded live (re-watching across etcd outages)."""

    def __init__(self, endpoints: list[str], prefix: str) -> None:
        self.events: list[WatchEvent] = []
        self.complete = True
        self._prefix, self._stop = prefix, threading.Event()
        self._store = EtcdStore(endpoints)
        self._next = self._store.get_prefix(prefix)[1] + 1
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="lease-history", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._watch = self._store.watch_prefix(self._prefix, self._next)
                for batch in self._watch:
                    self.events.extend(batch.events)
                    self._next = max(self._next, batch.revision + 1)
                    if self._stop.is_set():
                        return
            except WatchCompacted:
                self.complete = False
                self._next = self._store.get_prefix(self._prefix)[1] + 1
            except (StoreError, ValueError):
                self._stop.wait(0.5)

    def close(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.cancel()
        self._thread.join(timeout=5)
        self._store.close()


class ScenarioRun:
    """One run of a scenario (see the module doc)."""

    def __init__(self, scenario: Scenario, compiled: Any, *, say: Callable[[dict[str, Any]], None],
                 break_replay: bool = False, compile_cache_dir: Path | None = None,
                 reference: tuple[Any, float] | None = None) -> None:
        self.s, self.compiled, self.say = scenario, compiled, say
        self.reference = reference  # (the fault-free in-process run, its wall time); None: run it here
        self.program = compiled.program
        self.break_replay = break_replay
        self.compile_cache_dir = compile_cache_dir
        self.done = threading.Event()
        self._channel: grpc.Channel | None = None
        self.second: Any = None  # (compiled, reference digest) of the scenario's [second_job]
        self.second_outcome: dict[str, Any] = {}
        if scenario.second_job is not None:
            other, ref, _wall = prepared(scenario.second_job.job_file, scenario.second_job.steps, 0)
            self.second = (other, ref.state_digest)

    # -- the jobs -------------------------------------------------------------------------

    def _cluster_reference(self) -> Any:
        """The job run fault-free on the scenario's own cluster (``[job] reference = "cluster"``): a multi-host
        slice's collectives sum across processes in another order than one process does (docs/multihost.md)."""
        from rallypoint.client.submission import submit

        s, lc = self.s, self.lc
        self.say({"event": "chaos.reference", "on": "cluster"})
        return submit(self.compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, window=s.window,
                      policy=s.policy, checkpoint_every=s.checkpoint_every, on_no_spare=s.on_no_spare,
                      wait_timeout_s=s.wait_timeout_s, priority=s.priority)

    def _second_job(self) -> None:
        """Submit the scenario's second job once the first reaches its step; follow it to its end."""
        from rallypoint.client.submission import JobError, submit

        threading.current_thread().name = "second-job"
        sj = self.s.second_job
        assert sj is not None and self.second is not None
        while self.job.completed < sj.at_step and not self.done.is_set():
            time.sleep(0.05)
        if self.done.is_set():
            self.second_outcome = {"state": "not submitted", "reason": "the first job ended first"}
            return
        self.say({"event": "chaos.second_job", "job": self.second[0].name, "priority": sj.priority,
                  "step": self.job.completed})
        t0 = time.monotonic()
        try:
            r = submit(self.second[0], endpoints=self.lc.endpoints, cluster=self.lc.keys.cluster, priority=sj.priority)
            self.second_outcome = {"state": "finished", "digest": r.state_digest, "wall_s": round(time.monotonic() - t0, 3),
                                   "recoveries": len(r.recovery.get("recoveries", []))}
        except (JobError, RallypointError) as exc:
            self.second_outcome = {"state": "failed", "reason": str(exc)}

    def _check_second(self) -> Check:
        name, want = self.second[0].name, self.second[1]
        got = self.second_outcome
        if got.get("state") != "finished":
            return Check("second-job", False, f"job {name} did not finish: {got}")
        return Check("second-job", got["digest"] == want, f"job {name} (priority {self.s.second_job.priority}) "
                     f"digest {got['digest']} {'==' if got['digest'] == want else '!='} its reference {want} (bitwise)")

    def _watchdog(self, t0: float) -> None:
        """End the run past its time bound (a hung leader is the follower's to see: it switches by itself)."""
        while not self.done.wait(0.5):
            if time.monotonic() - t0 > self.s.time_bound_s * 1.5 + 30:
                self.job.time_out(f"timed out after {time.monotonic() - t0:.0f}s")
                return

    # -- the whole run ------------------------------------------------------------------------

    def run(self, state_dir: Path) -> dict[str, Any]:
        from rallypoint.client.jobspec import job_spec
        from rallypoint.client.reference import ReferenceExecutor

        s, program = self.s, self.program
        if self.reference is None:
            t_ref = time.perf_counter()
            self.reference = (ReferenceExecutor(self.compiled).run(), time.perf_counter() - t_ref)
        reference, fault_free_wall = self.reference
        schedule = s.schedule(list(program.slices))
        network = None
        storage = Storage(state_dir / "checkpoints") if {"disk_full", "disk_readonly"} & s.kinds else None
        corrupt_flag = state_dir / "corrupt-fault.json" if "corrupt" in s.kinds else None
        config = LocalClusterConfig(
            state_dir=state_dir, workers=s.workers or len(program.slices), spares=s.spares,
            devices_per_worker=s.devices_per_worker or max(sl.devices for sl in program.slices.values()),
            coordinators=s.coordinators, etcd_members=s.etcd_members, lease_ttl_s=s.lease_ttl_s,
            compile_cache_dir=self.compile_cache_dir if s.compile_cache else "",
            # a storage flag, without root; damaged in-memory checkpoint copies, corrupt state: when the scenario asks
            worker_faults=replace(storage.faults if storage else NO_FAULTS, corrupt_replicas=s.corrupt_replicas,
                                  corrupt_flag=str(corrupt_flag) if corrupt_flag else ""),
            coordinator_hooks=ExecutorHooks(skip_replay=self.break_replay), supervise=s.supervise)
        if "partition" in s.kinds:
            from rallypoint.chaos.network import start_partitionable_cluster

            self.lc, network = start_partitionable_cluster(config)
        else:
            self.lc = LocalCluster.start(config)
        lc = self.lc
        self.target = Target(lc, program.name, {n: sp.slice for n, sp in program.nodes.items()},
                             network=network, storage=storage, corrupt_flag=corrupt_flag)
        self.injectors = Injectors(self.target)
        self.job = ScenarioFollower(lc, self.target, self.injectors, done=self.done, say=self.say)
        self.scheduler = FaultScheduler(self.injectors, self.job, done=self.done, say=self.say)
        if s.reference == "cluster":  # the same job, fault-free, on this cluster first: what the faulted run must equal
            try:
                reference = self._cluster_reference()
                fault_free_wall = reference.wall_s
            except BaseException:
                lc.stop()
                if network is not None:
                    network.close()
                raise
        history = LeaseHistory(lc.endpoints, lc.keys.leases)
        started = time.time()
        t0 = time.monotonic()
        try:
            # A campaign injects a fault every few seconds on purpose: the job's failure policy (docs/recovery.md)
            # must not be what ends it; each recovery's own budget still applies.
            spec = job_spec(self.compiled, window=s.window, policy=s.policy, checkpoint_every=s.checkpoint_every,
                            on_no_spare=s.on_no_spare, wait_timeout_s=s.wait_timeout_s, priority=s.priority,
                            max_faults=10_000, verify_every=s.verify_every or None)
            spec.new_run = s.reference == "cluster"  # the reference run's commits stay under its run id
            threads = [threading.Thread(target=self.scheduler.run, args=(schedule, t0), daemon=True),
                       threading.Thread(target=self._watchdog, args=(t0,), daemon=True)]
            if self.second is not None:
                threads.append(threading.Thread(target=self._second_job, daemon=True))
            for th in threads:
                th.start()
            self.job.follow(spec)
            wall = time.monotonic() - t0
            self.done.set()
            for th in threads:
                th.join(timeout=30 if th.name != "second-job" else s.time_bound_s)
            evidence = self._evidence()
        finally:
            self.done.set()
            history.close()
            lc.stop()
            if network is not None:
                network.close()
            if storage is not None:
                storage.close()
        job = self.job
        checks = [
            check_digest(job.detail.get("state_digest") if job.outcome["state"] == "finished" else None,
                         reference.state_digest, resharded=job.detail.get("resharded") or (),
                         got_states=job.final_states, tolerance=job.detail.get("tolerance"),
                         want_states=_flat_states(reference.states),
                         nondeterministic=job.detail.get("nondeterministic_workers") or ()),
            check_applied_once(evidence["runtimes"], {n: NodeInfo(sp.slice, sp.every, sp.per == "microbatch")
                                                      for n, sp in program.nodes.items()},
                               microbatches=program.microbatches, steps=program.steps,
                               stateless=set(program.slices) - {st.slice for st in program.states.values()}),
            check_lease_history(history.events, history.complete),
            check_checkpoints(evidence["commits"]),
            check_outcome(job.outcome["state"], job.outcome.get("reason", ""), wall, expect=s.expect_outcome,
                          expect_reason=s.expect_reason, time_bound_s=s.time_bound_s),
        ]
        if self.second is not None:
            checks.append(self._check_second())
        if "suspend" in s.kinds:
            checks.append(check_suspends(job.suspends, evidence["leases_left"]))
        if s.expect_outcome == "failed":  # the state of a job expected to fail is not compared
            checks[0] = Check("final-state-digest", True, "not compared: the scenario expects the job to fail")
            checks[1] = Check("applied-exactly-once", True, "not checked: the scenario expects the job to fail")
        return self._summary(started, wall, fault_free_wall, checks, evidence, network, storage)

    def _evidence(self) -> dict[str, Any]:
        store = self.lc.store()
        try:
            record = store.get(self.lc.keys.job(self.program.name))
            commits = read_commits(store, self.lc.keys, self.program.name)
            leases_left = leases_of(store, self.lc.keys, self.program.name) if "suspend" in self.s.kinds else []
        finally:
            store.close()
        run_dir = Path(record.json()["run_dir"]) if record and record.json().get("run_dir") else None
        results: list[tuple[str, int, str | None]] = []
        for sl, cs in sorted(commits.items()):
            for c in cs:
                try:
                    restore_commit(c)
                    results.append((sl, c.step, None))
                except CheckpointCorrupt as exc:
                    results.append((sl, c.step, str(exc)))
        runtimes = read_records(run_dir) if run_dir else []
        return {"commits": results, "runtimes": runtimes, "record": record.json() if record else {},
                "leases_left": leases_left}

    def _summary(self, started: float, wall: float, fault_free_wall: float, checks: list[Check],
                 evidence: dict[str, Any], network: Any, storage: Any) -> dict[str, Any]:
        s, program, job = self.s, self.program, self.job
        total = useful = 0.0
        seen: set[tuple[str, int, int]] = set()
        progress: list[dict[str, Any]] = []
        first_runs: dict[str, list[float]] = {}
        for r in evidence["runtimes"]:
            for x in r["instances"]:
                total += x["c"]
                key = (x["n"], x["s"], x["m"])
                if key not in seen:
                    seen.add(key)
                    useful += x["c"]
                    first_runs.setdefault(x["n"], []).append(x["c"])
                progress.append({"t": x["t"], "node": x["n"], "step": x["s"]})
        progress.sort(key=lambda p: p["t"])
        per_node: dict[str, list[dict[str, Any]]] = {}
        for p in progress:
            per_node.setdefault(p["node"], []).append(p)
        thinned = [p for pts in per_node.values() for p in pts[:: max(1, len(pts) // 300)]]
        recoveries = sorted({**job.recoveries, **{(r["recovery"], r["detected_at"]): r
                                                  for r in job.detail.get("recoveries", [])}}.values(),
                            key=lambda r: r["detected_at"])
        mttrs = [r["mttr_s"] for r in recoveries if r.get("mttr_s") is not None]
        return {
            "scenario": s.name, "description": s.description, "seed": s.seed, "started_at": started,
            "ended_at": time.time(),
            "job": {"name": program.name, "steps": program.steps, "policy": s.policy,
                    "checkpoint_every": s.checkpoint_every or program.checkpoint_every},
            "cluster": {"workers": s.workers or len(program.slices), "spares": s.spares,
                        "devices_per_worker": s.devices_per_worker or 1, "etcd_members": s.etcd_members,
                        "network": network.mode if network is not None else "loopback",
                        "storage": storage.mode if storage is not None else "local disk"},
            "outcome": {**job.outcome, "wall_s": round(wall, 3), "expected": s.expect_outcome,
                        "time_bound_s": s.time_bound_s},
            "faults": self.scheduler.faults, "fired": dict(self.injectors.fired), "healed": dict(self.injectors.healed),
            "resumes": job.resumes, "recoveries": recoveries,
            **({"suspends": job.suspends} if "suspend" in s.kinds else {}),
            "second_job": self.second_outcome or None,
            "drains": job.detail.get("drains") or job.drains, "resharded": job.detail.get("resharded") or [],
            "stragglers": job.stragglers, "replayed_instances": job.detail.get("replayed_instances", {}),
            "window": job.detail.get("window"), "output_log_peak": job.detail.get("output_log_peak", {}),
            "invariants": [c.to_json() for c in checks], "ok": all(c.ok for c in checks),
            "goodput": {"useful_device_s": round(useful, 4), "redone_device_s": round(total - useful, 4),
                        "goodput": round(useful / total, 4) if total else None,
                        "steps_per_s": round(program.steps / wall, 3) if wall else None,
                        "fault_free_wall_s": round(fault_free_wall, 3),
                        # per node, the median compute of one instance (first runs): what a replay costs
                        "instance_s": {n: round(statistics.median(cs), 6) for n, cs in sorted(first_runs.items())}},
            "mttr_s": {"median": round(statistics.median(mttrs), 4) if mttrs else None,
                       "max": round(max(mttrs), 4) if mttrs else None},
            "progress": thinned,
        }


def run_scenario(scenario: Scenario, *, out_dir: Path | None = None, say: Callable[[dict[str, Any]], None] = print,
                 break_replay: bool = False, compile_cache_dir: Path | None = None) -> tuple[dict[str, Any], Path]:
    """Run ``scenario``; return its summary and the report folder written.

    ``compile_cache_dir``: the workers' compilation cache when the scenario keeps one (None: in the run's
    state folder, removed with it); the test suite passes one cache for all its runs.

    The libraries' logging in this process (Orbax warns through absl for each step folder the invariants
    restore) goes to the report folder's ``libraries.log``, not to the terminal between ``say``'s lines.
    """
    out = out_dir or Path("chaos-reports") / f"{scenario.name}-{time.strftime('%Y%m%dT%H%M%S')}"
    with library_logs_to(out / LIBRARY_LOG_FILE):
        compiled, reference, reference_wall = prepared(scenario.job_file, scenario.steps, scenario.checkpoint_every,
                                                      dict(scenario.settings))
        state = Path(tempfile.mkdtemp(prefix=f"rallypoint-chaos-{scenario.name}-"))
        ok = False
        try:
            summary = ScenarioRun(scenario, compiled, say=say, break_replay=break_replay,
                                  compile_cache_dir=compile_cache_dir, reference=(reference, reference_wall)).run(state)
            ok = bool(summary["ok"])
            if not ok:
                summary["logs"] = str(state / "logs")  # kept for whoever reads the report
        finally:
            if ok:
                shutil.rmtree(state, ignore_errors=True)
            else:
                say({"event": "chaos.logs", "dir": str(state / "logs")})
    return summary, write_report(out, summary)


_PREPARED: dict[tuple[Any, ...], tuple[Any, Any, float]] = {}


def prepared(job_file: Path | str, steps: int | None, checkpoint_every: int | None,
             settings: dict[str, str] | None = None) -> tuple[Any, Any, float]:
    """A scenario's job compiled, and its fault-free in-process reference run with that run's wall time.

    Both are deterministic in the job file (by content), the step count, the checkpoint interval and the job's
    ``settings`` (``--set``), so they are
    made once per process for each: the chaos suite runs a dozen scenarios of the same pipeline at 40 steps, and
    each compiled it and ran its reference again (several seconds each on a 2-core host).
    """
    from rallypoint.client.compile import compile_program, ensure_host_devices

    ensure_host_devices(8)
    from rallypoint.client.jobfile import load_program
    from rallypoint.client.reference import ReferenceExecutor

    path = Path(job_file).resolve()
    key = (str(path), hashlib.sha256(path.read_bytes()).hexdigest(), int(steps or 0), int(checkpoint_every or 0),
           tuple(sorted((settings or {}).items())))
    if key not in _PREPARED:
        program = load_program(job_file, steps=steps, settings=settings)
        if checkpoint_every:
            program.checkpoint_every = checkpoint_every
        compiled = compile_program(program)
        t = time.perf_counter()
        reference = ReferenceExecutor(compiled).run()
        _PREPARED[key] = (compiled, reference, time.perf_counter() - t)
    return _PREPARED[key]


def _flat_states(states: dict[str, Any]) -> dict[str, list[Any]]:
    """Pytrees of states -> their flat leaves as numpy arrays (what the wire carries)."""
    import jax
    import numpy as np

    return {n: [np.asarray(x) for x in jax.tree_util.tree_leaves(v)] for n, v in states.items()}
