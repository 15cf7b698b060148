"""Leader scale benchmark: the leader's CPU per step and per instance as a job grows, and where it saturates.

One leader (a real :class:`~rallypoint.orchestrator.job.executor.JobExecutor` on its own thread, a real etcd, a real
election) drives a job of 1, 16, 128 and 512 slices, a pipeline of one node per slice, on stand-in workers that
answer instantly: loads and grants are taken in memory, and each step's ``InstanceDone`` of every slice is put on
the executor's event queue as soon as the grant allows it. What is measured is the executor's thread alone (its
CPU clock, ``time.pthread_getcpuclockid``), read at each ``step.done`` it emits, over the steps after a warm-up
(the job runs without checkpoints: commits and the cut's moves are not in it):

* **flood**: the stand-ins report a step's instances within the grant that allows it (prebuilt messages, one
  queue put each, on the executor's thread: no second thread to wait for), so the leader's thread is the
  bottleneck. Its CPU per instance is the marginal cost of one event; ``sat_est_steps_s`` (one core over the CPU
  per step) is where it saturates, ``sat_steps_s`` the steps/s the run reached (lower on a loaded machine: it
  shares the cores, and waits on etcd for its periodic reads and records);
* **paced**: a driver thread reports each step at 5 steps/s; the leader's cores used (CPU seconds per wall
  second), the target being under half a core for 512 slices;
* **jobs**: several jobs of 128 slices on one leader (one executor thread each, as the service runs them), paced
  at 5 steps/s: the cores used by all of them and the CPU per instance.

Targets: the CPU per instance stays flat as slices grow (``flat_ratio``: 512 slices' flood CPU per instance over
16 slices', <= 2) and a 512-slice job at 5 steps/s uses under 0.5 of a core of the leader.

Writes a PNG plot (``--plot``, default ``bench/leader_scale.png``); the last stdout line is one JSON object
``{"bench": "leader_scale", ...}``; the table goes to stderr. Run: ``python bench/leader_scale.py`` (``make
bench``); ``--slices 1,16`` ``--steps 40`` ``--repeats 3`` to change the sizes, ``--compare FILE`` to draw an
earlier run's last line (its flood CPU per instance) beside this one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rallypoint.basics.logs import configure  # noqa: E402
from rallypoint.etcd.etcd_store import EtcdStore  # noqa: E402
from rallypoint.etcd.keys import Keys  # noqa: E402
from rallypoint.etcd.server import EtcdCluster  # noqa: E402
from rallypoint.orchestrator.control.election import LeaderElection  # noqa: E402
from rallypoint.orchestrator.job.executor import JobExecutor  # noqa: E402
from rallypoint.orchestrator.job.failures import WorkerCallFailed  # noqa: E402
from rallypoint.orchestrator.job.grants import StepGrant  # noqa: E402
from rallypoint.orchestrator.job.state import JobState  # noqa: E402
from rallypoint.orchestrator.job.workers import JobWorkers  # noqa: E402
from rallypoint.proto import rallypoint_pb2 as pb  # noqa: E402

B = pb.InputBinding
PACED_STEPS_S = 5.0
TARGET_CORES_512 = 0.5
TARGET_FLAT = 2.0
WARMUP = 5  # steps left out of each measurement (the first grants, the placement's aftermath)


def pipeline(job: str, slices: int, steps: int) -> pb.JobSpec:
    """``slices`` stages, one node each (``f<i>`` on ``s<i>``, its state ``p<i>``), each reading the previous one."""
    nodes, states = [], []
    for i in range(slices):
        inputs = [B(arg="p", kind=B.STATE, state=f"p{i}")]
        if i:
            inputs.insert(0, B(arg="x", kind=B.REF, node=f"f{i - 1}", output="y"))
        nodes.append(pb.NodeProgram(name=f"f{i}", slice=f"s{i}", every=1, inputs=inputs))
        states.append(pb.StateProgram(name=f"p{i}", slice=f"s{i}", producer_node=f"f{i}", producer_every=1))
    return pb.JobSpec(job=job, steps=steps, microbatches=1, window=2, checkpoint_every=0,
                      slices=[pb.SliceAssignment(slice=f"s{i}", mesh_shape=[1]) for i in range(slices)],
                      nodes=nodes, states=states)


class StandIns(JobWorkers):
    """The job's workers, answering at once in memory: a load is taken, a grant is noted for the driver."""

    def __init__(self, job: str, ready: dict[tuple[str, int], pb.InstanceDone] | None = None) -> None:
        super().__init__(job)
        self.until: dict[str, int] = {}
        self.slices: dict[str, list[str]] = {}
        self.cond = threading.Condition()
        self.ready = ready  # flood: (slice, step) -> its instance, reported within the grant
        self._ran: dict[str, int] = {}

    def load(self, requests: Mapping[str, pb.LoadJobRequest], addresses: Mapping[str, str]) -> dict[str, WorkerCallFailed]:
        for w, req in requests.items():
            gen = next(self._gens)
            self.identity[w], self.generation[w] = req.to, gen
            self.slices[w] = [sa.slice for sa in req.slices]
            self._ran[w] = int(req.start_step)
        return {}

    def grant(self, grants: Iterable[StepGrant]) -> None:
        if self.ready is not None:  # flood: the instances granted are done at once (one queue put each)
            for g in grants:
                gen = self.generation[g.worker]
                for s in range(self._ran[g.worker], g.until):
                    for sl in self.slices[g.worker]:
                        self.events.put(("done", (g.worker, gen, self.ready[(sl, s)])))
                self._ran[g.worker] = max(self._ran[g.worker], g.until)
            return
        with self.cond:
            for g in grants:
                self.until[g.worker] = g.until
            self.cond.notify_all()

    def unload(self, worker: str, *, flush_s: float = 0.0) -> bool:
        return True

    def unload_stale(self, worker: str, address: str, to: pb.Identity) -> None:
        pass

    def warm(self, worker: str, address: str, req: pb.WarmJobRequest, done: Any) -> None:
        done(worker, pb.WarmJobResponse(), "")

    def fetch_all(self) -> tuple[list[pb.StateValue], dict[str, WorkerCallFailed]]:
        return [], {}

    def close(self) -> None:
        pass


def loaded(w: StandIns, stop: threading.Event) -> None:
    with w.cond:
        while not w.slices and not stop.is_set():
            w.cond.wait(0.1)


def drive(w: StandIns, spec: pb.JobSpec, rate: float | None, stop: threading.Event, start: threading.Barrier) -> None:
    """Report every step's instances once every worker is granted it (and, paced, at ``rate`` steps/s), from when
    every job of the run is loaded."""
    node_of = {n.slice: n.name for n in spec.nodes}
    loaded(w, stop)
    start.wait()
    ws = sorted(w.slices)
    t0 = time.monotonic()
    for s in range(spec.steps):
        with w.cond:
            while not stop.is_set() and min((w.until.get(x, 0) for x in ws), default=0) <= s:
                w.cond.wait(0.1)
        if stop.is_set():
            return
        if rate:
            wait = t0 + s / rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        for x in ws:
            gen = w.generation[x]
            for sl in w.slices[x]:
                w.events.put(("done", (x, gen, pb.InstanceDone(node=node_of[sl], step=s, compute_s=0.01))))


def run_jobs(store: EtcdStore, keys: Keys, election: LeaderElection, slices: int, jobs: int, steps: int,
             rate: float | None, tag: str) -> dict[str, Any]:
    """``jobs`` jobs of ``slices`` slices on one leader (an executor thread each); their leader CPU and pace."""
    lease = store.grant_lease(600).id
    marks: list[list[tuple[int, float, float]]] = []  # per job: (step, thread CPU s, monotonic s) at each step.done
    runs = []
    start = threading.Barrier(jobs)
    for j in range(jobs):
        name = f"{tag}-j{j}"
        for i in range(slices):
            w = f"{name}-w{i}"
            store.put(keys.worker(w), json.dumps({"address": f"{w}:1", "data_address": f"{w}:2", "devices": 1}),
                      lease=lease)
            store.put(keys.device(w, 0), "{}", lease=lease)
        spec = pipeline(name, slices, steps)
        ready = None if rate else {(f"s{i}", s): pb.InstanceDone(node=f"f{i}", step=s, compute_s=0.01)
                                   for i in range(slices) for s in range(steps)}
        workers = StandIns(name, ready)
        mark: list[tuple[int, float, float]] = []
        marks.append(mark)
        clock_id: list[int] = []

        def emit(ev: pb.JobEvent, mark: list = mark, clock_id: list = clock_id) -> None:
            if ev.event == "step.done":
                mark.append((ev.step, time.clock_gettime(clock_id[0]), time.monotonic()))

        x = JobExecutor(spec, store=store, keys=keys, election=election, emit=emit, workers=workers)
        result: dict[str, Any] = {}

        def main(x: JobExecutor = x, clock_id: list = clock_id, result: dict = result) -> None:
            clock_id.append(time.pthread_getcpuclockid(threading.get_ident()))
            result["state"] = x.run()

        stop = threading.Event()
        runs.append((x, threading.Thread(target=main, name=f"executor-{name}"),
                     threading.Thread(target=drive, args=(workers, spec, rate, stop, start), name=f"driver-{name}")
                     if rate else None, stop, result))
    for x, t, d, stop, _ in runs:  # one job placed at a time (as jobs arrive), then all of them run at once
        t.start()
        if d is not None:
            loaded(x.workers, stop)  # type: ignore[arg-type]
            d.start()
    for x, t, d, stop, result in runs:
        t.join(timeout=600)
        stop.set()
        if d is not None:
            d.join()
        if result.get("state") is not JobState.SUCCEEDED:
            raise RuntimeError(f"job {x.spec.job} ended {result.get('state')}")
    store.revoke_lease(lease)
    cpu = sum(m[-1][1] - m[WARMUP][1] for m in marks)
    wall = max(m[-1][2] for m in marks) - min(m[WARMUP][2] for m in marks)
    n = steps - 1 - WARMUP
    per_step = cpu / (n * jobs)
    return {"slices": slices, "jobs": jobs, "rate": rate, "cpu_per_step_ms": per_step * 1e3,
            "cpu_per_instance_us": per_step / slices * 1e6, "cores": cpu / wall, "steps_s": n / wall,
            "sat_est_steps_s": 1.0 / per_step / jobs if per_step else float("inf")}


def plot(rows: list[dict[str, Any]], path: Path, before: dict[str, Any] | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flood = [r for r in rows if r["mode"] == "flood"]
    paced = [r for r in rows if r["mode"] == "paced"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    a.plot([r["slices"] for r in flood], [r["cpu_per_instance_us"] for r in flood], "o-", label="flood")
    a.plot([r["slices"] for r in paced], [r["cpu_per_instance_us"] for r in paced], "s--", label="5 steps/s")
    if before:  # an earlier run's last line (--compare)
        was = sorted((int(n), v) for n, v in before.get("cpu_per_instance_us", {}).items())
        a.plot([n for n, _ in was], [v for _, v in was], "x:", color="grey", label="flood, before")
    a.set(xscale="log", yscale="log", xlabel="slices", ylabel="leader CPU per instance (us)",
          title="cost per instance")
    a.legend()
    b.plot([r["slices"] for r in flood], [r["steps_s"] for r in flood], "o-", label="saturated (flood)")
    b.axhline(PACED_STEPS_S, color="grey", ls=":", label="5 steps/s")
    b.plot([r["slices"] for r in flood], [r["sat_est_steps_s"] for r in flood], "^:", label="one core / CPU per step")
    b.set(xscale="log" if flood else "linear", yscale="log" if flood else "linear", xlabel="slices", ylabel="steps/s",
          title="leader saturation")
    b.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slices", default="1,16,128,512")
    ap.add_argument("--steps", type=int, default=40, help="steps of each flood job (paced: 5 s of steps + warm-up)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each size (medians)")
    ap.add_argument("--jobs", type=int, default=4, help="jobs of 128 slices on one leader, paced (0: none)")
    ap.add_argument("--modes", default="flood,paced", help="flood, paced or both")
    ap.add_argument("--compare", help="a file holding an earlier run's last line, drawn beside this one")
    ap.add_argument("--plot", default=str(ROOT / "bench" / "leader_scale.png"))
    args = ap.parse_args()
    configure(level="WARNING")
    sizes = [int(s) for s in args.slices.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="leader-scale-") as tmp:
        etcd = EtcdCluster.start(members=1, base_dir=Path(tmp) / "etcd", tls=None)
        store = EtcdStore(etcd.endpoints, tls=None)
        keys = Keys("bench")
        election = LeaderElection(store, keys, "c1", ttl_s=5)
        try:
            if not election.try_acquire():
                raise RuntimeError("the bench's coordinator did not become the leader")
            k = 0
            for n in sizes:
                for mode, rate, steps in (("flood", None, args.steps),
                                          ("paced", PACED_STEPS_S, int(PACED_STEPS_S * 5) + WARMUP + 1)):
                    if mode not in args.modes.split(","):
                        continue
                    runs = []
                    for _ in range(args.repeats):
                        k += 1
                        runs.append(run_jobs(store, keys, election, n, 1, steps, rate, f"r{k}"))
                    row = {key: statistics.median([r[key] for r in runs]) if isinstance(runs[0][key], float) else runs[0][key]
                           for key in runs[0]}
                    rows.append({"mode": mode, **row})
                    print(f"{mode:6} slices {n:4d}: {row['cpu_per_instance_us']:8.1f} us/instance "
                          f"{row['cpu_per_step_ms']:8.2f} ms/step  {row['cores']:.3f} cores  {row['steps_s']:7.1f} "
                          f"steps/s (saturates near {row['sat_est_steps_s']:.1f})", file=sys.stderr, flush=True)
            if args.jobs:
                k += 1
                row = run_jobs(store, keys, election, 128, args.jobs, int(PACED_STEPS_S * 5) + WARMUP + 1,
                               PACED_STEPS_S, f"r{k}")
                rows.append({"mode": "jobs", **row})
                print(f"jobs   {args.jobs} x 128 slices: {row['cpu_per_instance_us']:8.1f} us/instance "
                      f"{row['cores']:.3f} cores at {row['steps_s']:.1f} steps/s each", file=sys.stderr, flush=True)
        finally:
            election.resign()
            store.close()
            etcd.stop()
    plot(rows, Path(args.plot), json.loads(Path(args.compare).read_text().splitlines()[-1]) if args.compare else None)
    flood = {r["slices"]: r for r in rows if r["mode"] == "flood"}
    paced = {r["slices"]: r for r in rows if r["mode"] == "paced"}
    base = flood.get(16) or flood.get(min(flood, default=0))
    top = flood.get(max(flood, default=0))
    flat = top["cpu_per_instance_us"] / base["cpu_per_instance_us"] if base and top else None
    big = paced[max(paced)] if paced else None
    out = {"bench": "leader_scale", "slices": sizes,
           "cpu_per_instance_us": {n: round(r["cpu_per_instance_us"], 1) for n, r in flood.items()},
           "cpu_per_step_ms": {n: round(r["cpu_per_step_ms"], 3) for n, r in flood.items()},
           "sat_steps_s": {n: round(r["steps_s"], 1) for n, r in flood.items()},
           "sat_est_steps_s": {n: round(r["sat_est_steps_s"], 1) for n, r in flood.items()},
           "paced_cores": {n: round(r["cores"], 3) for n, r in paced.items()},
           "jobs": {k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}
           if args.jobs else None,
           "flat_ratio": round(flat, 2) if flat is not None else None, "flat_target": TARGET_FLAT,
           "flat_met": flat is not None and flat <= TARGET_FLAT,
           "cores_at_5_steps_s": round(big["cores"], 3) if big else None, "cores_target": TARGET_CORES_512,
           "cores_met": big is not None and big["cores"] < TARGET_CORES_512, "plot": os.path.relpath(args.plot, ROOT)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
