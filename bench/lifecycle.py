"""Lifecycle benchmark: a suspend and resume of a running job against a kill's MTTR, on one cluster, in one run.

The pipeline example (``examples/pipeline_mlp.py``, ``--steps`` steps, checkpoints every
``--every``) runs again and again on one embedded cluster (4 workers and a spare of one
device each, one coordinator, warm spares off unless ``--warm-spares``), each run a new
run of the same job, the two kinds alternated, ``--runs`` times each:

* **suspend and resume**: submitted detached (``submit_detached``) and followed
  (``watch``); once the client has seen every step below ``--at`` done, a suspend is
  asked (``control(job, "suspend")``). Timed from that call, on this process's clock:
  the request taken (the reply), ``job.stopping`` (the boundary chosen: every step
  granted by then, ``window`` ahead, still runs), the last ``step.done``, the
  ``job.suspended`` event, the job record saying ``suspended``, and no device leased to
  the job any more (the record and the workers' leases polled in etcd every 10 ms) =
  **suspend to released**. Then ``resume``, timed from its call to the job running again
  (``job.started``) and to its first ``step.done`` = **resume to first step**. The
  **pause** is their sum; the **gap** counts from the last ``step.done`` before the stop
  instead of the request (the steps after the request are work done, not lost). The time
  the job held nothing between the two is the operator's and is not counted. The
  resumed run's ``job.finished`` gives the instances replayed and the recoveries
  (target: none) and the state digest;
* **kill**: submitted attached (``submit``), its worker of ``--target`` SIGKILLed once
  every step below ``--at`` is done (``FaultInjector``): the recovery's **MTTR**
  (detection to the lost work redone, ``job.recovered``; the other slices' catch-up after
  it is not in it), the **stall** (the SIGKILL to the job's next ``step.done``), the
  checkpoint restored and the instances replayed. The killed worker is replaced by a
  fresh one before the next run, so each run starts with 4 workers and a spare.

Reported: medians, min and max over the runs; the ratios pause / MTTR and gap / stall
(medians); that every run ends with the state digest of the in-process reference
(``bitwise``). The table goes to stderr; the last stdout line is one JSON object
``{"bench": "lifecycle", ...}``. ``--strict`` exits 1 when a suspend replayed anything
or a run was not bitwise equal. Run: ``python bench/lifecycle.py`` (``make bench``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rallypoint.client.compile import ensure_host_devices  # noqa: E402

ensure_host_devices(8)

from bench.dispatch import pipeline_module  # noqa: E402
from rallypoint.basics.logs import configure  # noqa: E402
from rallypoint.client.compile import CompiledProgram, compile_program  # noqa: E402
from rallypoint.client.commands.faults import Fault, FaultInjector  # noqa: E402
from rallypoint.client.lifecycle import control, submit_detached, watch  # noqa: E402
from rallypoint.client.reference import ReferenceExecutor  # noqa: E402
from rallypoint.client.submission import JobStoppedError, resume, submit  # noqa: E402
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig  # noqa: E402
from rallypoint.etcd.cluster_view import read_cluster  # noqa: E402
from rallypoint.proto import rallypoint_pb2 as pb  # noqa: E402

WORKERS, SPARES = 4, 1
POLL_S = 0.01
WAIT_S = 120.0


def where(lc: LocalCluster) -> dict[str, Any]:
    return {"endpoints": lc.endpoints, "cluster": lc.keys.cluster}


def job_state(lc: LocalCluster, store: Any, job: str) -> tuple[str, int]:
    """The job record's state, and the devices leased to the job (one etcd read each)."""
    kv = store.get(lc.keys.job(job))
    state = str(kv.json().get("state", "")) if kv is not None else ""
    held = sum(h.job == job for w in read_cluster(store, lc.keys).workers.values() for h in w.holders.values())
    return state, held


def settle(lc: LocalCluster) -> None:
    """Wait until the cluster is as it started: WORKERS + SPARES workers registered, none leased."""
    store = lc.store()
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            snap = read_cluster(store, lc.keys)
            if len(snap.workers) == WORKERS + SPARES and not any(w.holders for w in snap.workers.values()):
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"the cluster did not settle: {sorted(snap.workers)}, leased "
                                 f"{sorted(w for w, s in snap.workers.items() if s.holders)}")
            time.sleep(0.1)
    finally:
        store.close()


def suspend_resume(lc: LocalCluster, compiled: CompiledProgram, at: int, settings: dict[str, Any]) -> dict[str, Any]:
    got = submit_detached(compiled, **where(lc), new_run=True, **settings)
    job = got["job"]
    reached = threading.Event()
    stopped: dict[str, Any] = {}

    def on_event(ev: pb.JobEvent) -> None:
        if ev.event == "step.done":
            stopped["last_step"] = time.perf_counter()
            if ev.step + 1 >= at and not reached.is_set():
                stopped["asked_at"] = int(ev.step) + 1
                reached.set()
        elif ev.event == "job.stopping":
            stopped.setdefault("stopping", time.perf_counter())
            stopped["boundary"] = json.loads(ev.detail or "{}").get("boundary")
            stopped["completed"] = int(ev.step)

    def follow() -> None:
        try:
            watch(job, **where(lc), on_event=on_event)
            stopped["error"] = "the job finished before it was suspended"
        except JobStoppedError as exc:
            stopped.update(state=exc.state, event=time.perf_counter())
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            stopped["error"] = repr(exc)
        finally:
            reached.set()

    follower = threading.Thread(target=follow, name="bench-watch", daemon=True)
    follower.start()
    if not reached.wait(WAIT_S) or "error" in stopped:
        raise SystemExit(f"job {job}: step {at} not reached ({stopped.get('error', 'timed out')})")
    store = lc.store()
    try:
        t0 = time.perf_counter()
        reply = control(job, "suspend", **where(lc), by="bench", reason="bench/lifecycle.py")
        taken = time.perf_counter()
        suspended = released = None
        while released is None:
            state, held = job_state(lc, store, job)
            now = time.perf_counter()
            if state == "suspended" and suspended is None:
                suspended = now
            if suspended is not None and held == 0:
                released = now
            elif now - t0 > WAIT_S:
                raise SystemExit(f"job {job}: not released {WAIT_S:.0f} s after the suspend (state {state}, "
                                 f"{held} devices held)")
            else:
                time.sleep(POLL_S)
        cut = int(store.get(lc.keys.job(job)).json().get("cut") or 0)
    finally:
        store.close()
    follower.join(WAIT_S)
    if stopped.get("state") != "suspended":
        raise SystemExit(f"job {job}: the watch ended with {stopped} (reply: {reply.message})")

    marks: dict[str, float] = {}

    def on_resumed(ev: pb.JobEvent) -> None:
        if ev.event in ("job.started", "step.done"):
            marks.setdefault(ev.event, time.perf_counter())
            marks.setdefault(f"{ev.event} step", ev.step)

    t1 = time.perf_counter()
    done = resume(job, **where(lc), on_event=on_resumed)
    replayed = done.get("replayed_instances") or {}
    return {"control_s": taken - t0, "stopping_s": stopped.get("stopping", t0) - t0, "event_s": stopped["event"] - t0,
            "record_suspended_s": suspended - t0, "released_s": released - t0,
            "resume_running_s": marks["job.started"] - t1, "first_step_s": marks["step.done"] - t1,
            "pause_s": (released - t0) + (marks["step.done"] - t1), "last_step_s": stopped["last_step"] - t0,
            "gap_s": (released - stopped["last_step"]) + (marks["step.done"] - t1),
            "asked_at": stopped["asked_at"], "completed": stopped.get("completed"), "boundary": stopped.get("boundary"),
            "cut": cut, "start_step": done.get("start_step"),
            "first_step": int(marks["step.done step"]), "replayed": sum(replayed.values()),
            "recoveries": len(done.get("recoveries") or []), "digest": done.get("state_digest")}


def kill(lc: LocalCluster, compiled: CompiledProgram, at: int, target: str, settings: dict[str, Any],
         fresh: str) -> dict[str, Any]:
    injector = FaultInjector([Fault(target, target, at, "kill")], lc.endpoints, lc.keys.cluster)
    marks: dict[str, float] = {}

    def on_event(ev: pb.JobEvent) -> None:
        injector.on_event(ev)
        if injector.fired and "killed" not in marks:
            marks["killed"] = time.perf_counter()
        elif ev.event == "step.done" and "killed" in marks and ev.step >= at:
            marks.setdefault("next_step", time.perf_counter())

    result = submit(compiled, **where(lc), new_run=True, on_event=on_event, **settings)
    fired = injector.fired[0] if injector.fired else {"error": "the fault did not fire"}
    if "error" in fired:
        raise SystemExit(f"the kill of {target} at step {at}: {fired['error']}")
    lc.reap(fired["worker"])
    lc.spawn("worker", fresh)
    rec = result.recovery
    recs = [r for r in rec.get("recoveries", []) if r.get("mttr_s") is not None]
    if len(recs) != 1:
        raise SystemExit(f"the kill of {target} at step {at}: {len(recs)} recoveries with an MTTR, not 1: {recs}")
    return {"mttr_s": recs[0]["mttr_s"], "phases": recs[0].get("phases", {}),
            "stall_s": marks["next_step"] - marks["killed"],
            "checkpoint_step": recs[0].get("checkpoint_step"),
            "replayed": sum((rec.get("replayed_instances") or {}).values()), "digest": result.state_digest,
            "worker": fired["worker"]}


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="checkpoint every K steps")
    ap.add_argument("--at", type=int, default=17, help="suspend, or kill, once every step below this is done")
    ap.add_argument("--target", default="stage2", help="the slice whose worker is killed")
    ap.add_argument("--runs", type=int, default=3, help="runs of each side, alternated")
    ap.add_argument("--warm-spares", type=int, default=0, help="the job's warm_spares (0: none)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args()
    configure(level="error")
    compiled = compile_program(pipeline_module().build(steps=args.steps))
    reference = ReferenceExecutor(compiled).run().state_digest
    settings = {"checkpoint_every": args.every, "warm_spares": args.warm_spares}
    t_start = time.perf_counter()
    suspends: list[dict[str, Any]] = []
    kills: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rallypoint-bench-lifecycle-") as tmp:
        lc = LocalCluster.start(LocalClusterConfig(state_dir=Path(tmp), workers=WORKERS, spares=SPARES,
                                                   devices_per_worker=1, coordinators=1))
        try:
            for i in range(args.runs):
                settle(lc)
                suspends.append(suspend_resume(lc, compiled, args.at, settings))
                settle(lc)
                kills.append(kill(lc, compiled, args.at, args.target, settings, f"w{WORKERS + SPARES + i}"))
            settle(lc)
        finally:
            lc.stop()
    wall = time.perf_counter() - t_start

    s_keys = ("control_s", "stopping_s", "last_step_s", "event_s", "record_suspended_s", "released_s",
              "resume_running_s", "first_step_s", "pause_s", "gap_s")
    sus = {k: spread([r[k] for r in suspends]) for k in s_keys}
    sus |= {"replayed_instances": [r["replayed"] for r in suspends],
            "recoveries": [r["recoveries"] for r in suspends], "asked_at_step": [r["asked_at"] for r in suspends],
            "completed_at_stopping": [r["completed"] for r in suspends], "boundary": [r["boundary"] for r in suspends],
            "cut": [r["cut"] for r in suspends],
            "first_step": [r["first_step"] for r in suspends],
            "bitwise": all(r["digest"] == reference for r in suspends)}
    phases = sorted({p for r in kills for p in r["phases"]})
    kil = {"mttr_s": spread([r["mttr_s"] for r in kills]), "stall_s": spread([r["stall_s"] for r in kills]),
           "phases_s": {p: round(statistics.median([r["phases"].get(p, 0.0) for r in kills]), 4) for p in phases},
           "checkpoint_step": [r["checkpoint_step"] for r in kills],
           "replayed_instances": [r["replayed"] for r in kills],
           "bitwise": all(r["digest"] == reference for r in kills)}
    ratio = sus["pause_s"]["median"] / kil["mttr_s"]["median"] if kil["mttr_s"]["median"] else None
    to_stall = sus["gap_s"]["median"] / kil["stall_s"]["median"] if kil["stall_s"]["median"] else None
    out = {"bench": "lifecycle", "steps": args.steps, "every": args.every, "at": args.at, "target": args.target,
           "runs": args.runs, "warm_spares": args.warm_spares, "suspend": sus, "kill": kil,
           "pause_to_mttr": round(ratio, 3) if ratio is not None else None,
           "gap_to_stall": round(to_stall, 3) if to_stall is not None else None,
           "bitwise": sus["bitwise"] and kil["bitwise"], "wall_s": round(wall, 1)}
    out["targets"] = {"suspend_replays_nothing": all(r["replayed"] == 0 and r["recoveries"] == 0 for r in suspends),
                      "bitwise": out["bitwise"]}

    w = sys.stderr.write
    w(f"pipeline {args.steps} steps, checkpoints every {args.every}, suspend or kill ({args.target}) once steps "
      f"below {args.at} are done; {WORKERS} workers + {SPARES} spare, warm spares {args.warm_spares}; "
      f"{args.runs} run(s) each, alternated, on one cluster ({wall:.0f} s)\n")
    w(f"{'':38}{'median':>9}{'min':>9}{'max':>9}\n")
    rows = [("suspend: request taken", sus["control_s"]), ("suspend: job.stopping", sus["stopping_s"]),
            ("suspend: last step.done", sus["last_step_s"]),
            ("suspend: job.suspended event", sus["event_s"]), ("suspend: record suspended", sus["record_suspended_s"]),
            ("suspend: no device held", sus["released_s"]), ("resume: job.started", sus["resume_running_s"]),
            ("resume: first step.done", sus["first_step_s"]), ("pause (released + first step)", sus["pause_s"]),
            ("gap (last step to released + first)", sus["gap_s"]),
            ("kill: MTTR", kil["mttr_s"]), ("kill: SIGKILL to next step.done", kil["stall_s"])]
    for name, s in rows:
        w(f"{name:38}{s['median']:>9.3f}{s['min']:>9.3f}{s['max']:>9.3f}\n")
    w(f"suspend: asked with {sus['asked_at_step']} steps done (as the client saw), {sus['completed_at_stopping']} at "
      f"job.stopping, boundary {sus['boundary']}, cut {sus['cut']}, first step after resume {sus['first_step']}, "
      f"instances replayed {sus['replayed_instances']}, recoveries {sus['recoveries']}, bitwise {sus['bitwise']}\n")
    w(f"kill: restored from steps {kil['checkpoint_step']}, instances replayed {kil['replayed_instances']}, "
      f"phases (median) {kil['phases_s']}, bitwise {kil['bitwise']}\n")
    w(f"pause / kill MTTR (medians): {out['pause_to_mttr']}; gap / kill stall: {out['gap_to_stall']}\n")
    print(json.dumps(out))
    return 1 if args.strict and not all(out["targets"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
