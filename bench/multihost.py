"""Multi-host slice benchmark: a slice of 2 members x 2 devices against 1 member x 4, and a member kill's MTTR.

One exported train step (an MLP layer, the batch sharded over the slice's 4 devices, the
weights replicated, so every step's gradient is an all-reduce) runs on a slice's JAX
distributed group (:mod:`rallypoint.workers.gang.group`: member processes joined by
``jax.distributed``, gloo on CPU), in one run:

* **steady state**: steps/s of the group of 2 members x 2 devices (the all-reduce crosses
  processes) against a group of 1 member x 4 devices (the same programs, the same
  protocol), medians over ``--repeats``, and their ratio;
* **a member kill** of the 2x2 slice at step ``--kill-at`` after a cut at ``--every``: its
  MTTR split into detection (SIGKILL to the group's request failing), abort (the survivor
  stopped), gang lease (both members' devices leased again in one etcd transaction, on a
  real etcd holding ``--workers`` registered workers), group formation, restore (Orbax,
  each member its shards) and replay (the steps from the cut to the kill), with the final
  weights checked bitwise against the run without the kill;
* ``--largest``: the largest group formed here, trying 2, 4, 8, ... members of one device
  each up to ``--largest``: each one's formation time and one all-reduce;
* **on the cluster** (``--cluster-steps``, 0 skips it): ``examples/multihost.py`` (one data-parallel
  slice of 4 devices) on an embedded cluster of workers of 2 devices (a gang of two) against the
  same job on one worker of 4 devices, steady-state steps/s side by side (from the step events,
  after the first five steps); then the gang with member 1's worker SIGKILLed three quarters in: the
  recovery's MTTR by phase, where the restore read from (the in-memory tier's copies of each
  member's shards, or the disk), and the final state bitwise equal to the gang's run without it,
  ``--kill-repeats`` times each with warm spares off and on (the default: each spare a new gang
  would take keeps a member process started, JAX imported, and the members share the workers'
  compilation cache), alternated: the MTTR medians and their ratio.

The last stdout line is one JSON object ``{"bench": "multihost", ...}``; the table goes to
stderr. Run: ``python bench/multihost.py`` (``make bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rallypoint.client.compile import ensure_host_devices  # noqa: E402

ensure_host_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from rallypoint.basics.logs import configure  # noqa: E402
from rallypoint.workers.gang.group import GroupLost, SliceGroup  # noqa: E402

QUIET = subprocess.DEVNULL  # the members' stderr (gloo's connection lines); a member that fails to join says why


def train_step(devices: int, batch: int, width: int) -> bytes:
    mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
    data, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

    def step(w: jax.Array, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        def loss(w: jax.Array) -> jax.Array:
            return jnp.mean((jnp.tanh(x @ w) - y) ** 2)
        value, grad = jax.value_and_grad(loss)(w)
        return w - 0.1 * grad, value

    f = jax.jit(step, in_shardings=(rep, data, data), out_shardings=(rep, rep))
    avals = (jax.ShapeDtypeStruct((width, width), jnp.float32, sharding=rep),
             jax.ShapeDtypeStruct((batch, width), jnp.float32, sharding=data),
             jax.ShapeDtypeStruct((batch, width), jnp.float32, sharding=data))
    return bytes(jax.export.export(f)(*avals).serialize())


class Job:
    """The benchmark's training loop on one group: a deterministic batch per step."""

    def __init__(self, batch: int, width: int) -> None:
        self.batch, self.width = batch, width
        self.w0 = np.random.default_rng(1).standard_normal((width, width)).astype(np.float32) / np.sqrt(width)
        self.teacher = np.random.default_rng(2).standard_normal((width, width)).astype(np.float32) / np.sqrt(width)

    def data(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        x = np.random.default_rng(100 + step).standard_normal((self.batch, self.width)).astype(np.float32)
        return x, np.tanh(x @ self.teacher).astype(np.float32)

    def setup(self, group: SliceGroup, program: bytes, devices: int) -> None:
        group.mesh("m", [devices], ["d"])
        group.load("step", program, "m")

    def run(self, group: SliceGroup, start: int, stop: int) -> list[float]:
        times = []
        for s in range(start, stop):
            t0 = time.perf_counter()
            x, y = self.data(s)
            group.put("x", x, "m", ["d"])
            group.put("y", y, "m", ["d"])
            group.call("step", ["w", "x", "y"], ["w", "loss"])
            group.fetch("loss")
            times.append(time.perf_counter() - t0)
        return times


def steady(job: Job, program: bytes, members: int, local: int, steps: int) -> float:
    """Steps/s of one group, after two warm-up steps (compilation)."""
    group = SliceGroup.form(members, local, stderr=QUIET)
    try:
        job.setup(group, program, members * local)
        group.put("w", job.w0, "m", [])
        job.run(group, 0, 2)
        return 1.0 / statistics.median(job.run(group, 2, 2 + steps))
    finally:
        group.close()


def gang_lease_s(workers: int, base: Path) -> float:
    """One gang lease of 2 x 2 devices on a real etcd holding ``workers`` registered workers."""
    from rallypoint.etcd.keys import Keys
    from rallypoint.etcd.server import EtcdCluster
    from rallypoint.etcd.etcd_store import EtcdStore
    from rallypoint.orchestrator.control.devices import DeviceLeases
    from rallypoint.workers.registration import try_register

    cluster = EtcdCluster.start(members=1, base_dir=base / "etcd")
    store = EtcdStore(cluster.endpoints)
    try:
        keys = Keys("bench")
        lease = store.grant_lease(60).id
        for i in range(workers):
            try_register(store, keys, f"w{i:03d}", {"worker": f"w{i:03d}", "address": "", "pid": 0, "devices": 2,
                                                     "state": "serving"}, [{"index": 0}, {"index": 1}], lease)
        t0 = time.perf_counter()
        DeviceLeases(store, keys).allocate_gang("job", "stage0", 4)
        return time.perf_counter() - t0
    finally:
        store.close()
        cluster.stop()


def member_kill(job: Job, program: bytes, every: int, kill_at: int, steps: int, workers: int,
                base: Path) -> dict[str, Any]:
    cut = {"w": [{"value": "w", "mesh": "m", "spec": [], "shape": [job.width, job.width], "dtype": "float32"}]}
    ref = SliceGroup.form(2, 2, stderr=QUIET)  # the run without the kill
    try:
        job.setup(ref, program, 4)
        ref.put("w", job.w0, "m", [])
        job.run(ref, 0, steps)
        expected = ref.fetch("w")
    finally:
        ref.close()
    group = SliceGroup.form(2, 2, stderr=QUIET)
    try:
        job.setup(group, program, 4)
        group.put("w", job.w0, "m", [])
        job.run(group, 0, every)
        group.save(str(base / "cut"), {"w": ["w"]})
        job.run(group, every, kill_at)
        t0 = time.perf_counter()
        os.kill(group.members[1].pid, signal.SIGKILL)
        try:
            job.run(group, kill_at, kill_at + 1)
            raise SystemExit("the killed member's group went on")
        except GroupLost:
            detected = time.perf_counter()
        group.abort()
        aborted = time.perf_counter()
    finally:
        group.abort()
    lease_s = gang_lease_s(workers, base)
    t1 = time.perf_counter()
    again = SliceGroup.form(2, 2, stderr=QUIET)
    try:
        formed = time.perf_counter()
        job.setup(again, program, 4)
        again.restore(str(base / "cut"), cut)
        restored = time.perf_counter()
        job.run(again, every, kill_at + 1)
        replayed = time.perf_counter()
        job.run(again, kill_at + 1, steps)
        bitwise = bool(np.array_equal(again.fetch("w"), expected))
    finally:
        again.close()
    phases = {"detection_s": detected - t0, "abort_s": aborted - detected, "gang_lease_s": lease_s,
              "formation_s": formed - t1, "restore_s": restored - formed, "replay_s": replayed - restored}
    return {**{k: round(v, 4) for k, v in phases.items()}, "mttr_s": round(sum(phases.values()), 4),
            "replayed_steps": kill_at + 1 - every, "bitwise": bitwise}


def largest(limit: int) -> list[dict[str, Any]]:
    out = []
    n = 2
    while n <= limit:
        t0 = time.perf_counter()
        try:
            group = SliceGroup.form(n, 1, request_timeout_s=120.0, stderr=QUIET)
        except GroupLost as exc:
            out.append({"members": n, "formed": False, "error": str(exc)[:200]})
            break
        formed = time.perf_counter() - t0
        try:
            group.mesh("m", [n], ["d"])
            ones = np.ones((n, 4), np.float32)
            group.put("x", ones, "m", ["d"])
            t1 = time.perf_counter()
            group.load("sum", _sum_program(n), "m")
            group.call("sum", ["x"], ["s"])
            ok = float(group.fetch("s")) == 4.0 * n
            out.append({"members": n, "formed": True, "formation_s": round(formed, 3),
                        "allreduce_s": round(time.perf_counter() - t1, 3), "correct": ok})
        finally:
            group.close()
        n *= 2
    return out


def _sum_program(n: int) -> bytes:
    from jax.sharding import AbstractMesh

    mesh = AbstractMesh((n,), ("d",))
    f = jax.jit(lambda x: (jnp.sum(x),), in_shardings=NamedSharding(mesh, P("d")),
                out_shardings=(NamedSharding(mesh, P()),))
    return bytes(jax.export.export(f)(jax.ShapeDtypeStruct((n, 4), jnp.float32,
                                                            sharding=NamedSharding(mesh, P("d")))).serialize())


def cluster_runs(steps: int, kill_at: int, kill_repeats: int = 3, every: int = 20) -> dict[str, Any]:
    """``examples/multihost.py`` on the embedded cluster: a gang of 2 workers x 2 against 1 worker x 4, both
    checkpointing every ``every`` steps (a gang's multi-process Orbax save writes for about 0.25 s here, and a
    save waits for the one before it: at every few 15 ms steps the saves, not the steps, would be timed)."""
    from rallypoint.client.compile import compile_program
    from rallypoint.client.jobfile import load_program
    from rallypoint.client.submission import submit
    from rallypoint.cluster.local import LocalCluster, LocalClusterConfig
    from rallypoint.proto import rallypoint_pb2 as pb

    compiled = compile_program(load_program(ROOT / "examples" / "multihost.py", steps=steps))

    def run(workers: int, per: int, spares: int, kill: bool, warm: bool = True) -> tuple[Any, float]:
        with tempfile.TemporaryDirectory(prefix="rallypoint-bench-multihost-") as tmp:
            lc = LocalCluster.start(LocalClusterConfig(state_dir=Path(tmp), workers=workers, spares=spares,
                                                       devices_per_worker=per, coordinators=1,
                                                       compile_cache_dir=Path(tmp) / "compile-cache"))
            at: list[float] = []
            killed: list[str] = []

            def on_event(ev: pb.JobEvent) -> None:
                if ev.event == "step.done":
                    at.append(time.perf_counter())
                    if kill and ev.step == kill_at and not killed:
                        detail = _placement(lc, compiled.program.name)
                        killed.append(detail["dp"]["members"][1]["worker"])
                        lc.signal(killed[0], signal.SIGKILL)
            try:
                result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=every,
                                on_event=on_event, warm_spares=None if warm else 0)
            finally:
                lc.stop()
        rate = (len(at) - 6) / (at[-1] - at[5]) if len(at) > 6 else 0.0
        return result, rate

    # steady state without warm spares: their member processes start beside the job's own (a JAX import each),
    # which on a machine of few cores is felt in the first seconds measured
    gang, gang_rate = run(2, 2, 0, False, warm=False)
    one, one_rate = run(1, 4, 0, False, warm=False)
    kills: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(kill_repeats):  # alternated, so both see the same machine
        for warm in (False, True):
            killed, _ = run(2, 2, 2, True, warm)
            rec = (killed.recovery.get("recoveries") or [{}])[0]
            kills[warm].append({"mttr_s": rec.get("mttr_s"), "phases": rec.get("phases"),
                                "checkpoint_step": rec.get("checkpoint_step"), "restore_tiers": rec.get("restore_tiers"),
                                "bitwise": killed.state_digest == gang.state_digest})

    def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
        ranked = sorted(runs, key=lambda r: r["mttr_s"] if r["mttr_s"] is not None else float("inf"))
        return ranked[len(ranked) // 2] | {"mttr_s_all": [r["mttr_s"] for r in runs],
                                           "bitwise": all(r["bitwise"] for r in runs)}

    cold, warmed = median_run(kills[False]), median_run(kills[True])
    return {"steps": steps, "checkpoint_every": every, "steps_per_s_gang_2x2": round(gang_rate, 2),
            "steps_per_s_one_worker_4": round(one_rate, 2),
            "ratio": round(gang_rate / one_rate, 3) if one_rate else None, "kill_cold": cold, "kill_warm": warmed,
            "mttr_ratio_warm": round(warmed["mttr_s"] / cold["mttr_s"], 3)
            if warmed["mttr_s"] and cold["mttr_s"] else None}


def _placement(lc: Any, job: str) -> dict[str, Any]:
    store = lc.store()
    try:
        kv = store.get(lc.keys.job(job))
        return dict(kv.json()["placement"]) if kv is not None else {}
    finally:
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per steady-state run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--every", type=int, default=4, help="the cut before the kill")
    ap.add_argument("--kill-at", type=int, default=7)
    ap.add_argument("--kill-steps", type=int, default=10, help="steps of the killed run")
    ap.add_argument("--workers", type=int, default=100, help="registered workers when the gang is leased again")
    ap.add_argument("--largest", type=int, default=8, help="try groups of 2, 4, ... members up to this (0: skip)")
    ap.add_argument("--cluster-steps", type=int, default=60, help="steps of the cluster runs (0: skip them)")
    ap.add_argument("--kill-repeats", type=int, default=3, help="cluster kill runs with warm spares off, and on")
    args = ap.parse_args()
    configure(stream=sys.stderr, level="warning")
    job = Job(args.batch, args.width)
    program = train_step(4, args.batch, args.width)
    two, one = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine
        two.append(steady(job, program, 2, 2, args.steps))
        one.append(steady(job, program, 1, 4, args.steps))
    with tempfile.TemporaryDirectory(prefix="rallypoint-bench-multihost-") as tmp:
        kill = member_kill(job, program, args.every, args.kill_at, args.kill_steps, args.workers, Path(tmp))
    groups = largest(args.largest) if args.largest else []
    # the kill three quarters in: the checkpoint at every 20 steps is committed by then, and its in-memory copies
    # pushed (a gang's save takes about 0.5 s from start to commit here, some 15 steps)
    cluster = (cluster_runs(args.cluster_steps, args.cluster_steps * 3 // 4, args.kill_repeats)
               if args.cluster_steps else {})
    result = {"bench": "multihost", "batch": args.batch, "width": args.width,
              "steps_per_s_2x2": round(statistics.median(two), 2), "steps_per_s_1x4": round(statistics.median(one), 2),
              "ratio": round(statistics.median(two) / statistics.median(one), 3),
              "kill": kill, "largest": groups, "cluster": cluster}
    say = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    say(f"steady state ({args.batch}x{args.width}, medians of {args.repeats}): 2 members x 2 devices "
        f"{result['steps_per_s_2x2']} steps/s, 1 member x 4 devices {result['steps_per_s_1x4']} steps/s, "
        f"ratio {result['ratio']}")
    say("member kill: " + ", ".join(f"{k} {v}" for k, v in kill.items()))
    for g in groups:
        say(f"group of {g['members']} members: " + ", ".join(f"{k} {v}" for k, v in g.items() if k != "members"))
    if cluster:
        say(f"on the cluster ({args.cluster_steps} steps of examples/multihost.py): gang of 2 workers x 2 "
            f"{cluster['steps_per_s_gang_2x2']} steps/s, one worker of 4 {cluster['steps_per_s_one_worker_4']} "
            f"steps/s, ratio {cluster['ratio']}")
        for name, k in (("member kill, warm spares off", cluster["kill_cold"]),
                        ("member kill, warm spares on", cluster["kill_warm"])):
            say(f"{name}: MTTR median {k['mttr_s']} s of {k['mttr_s_all']}, its phases {k['phases']}, "
                f"restored from {k['restore_tiers']}, bitwise {k['bitwise']}")
        say(f"MTTR with warm spares / without: {cluster['mttr_ratio_warm']}")
    print(json.dumps(result))
    ok = kill["bitwise"] and all(g.get("correct", False) for g in groups)
    return 0 if ok and (not cluster or (cluster["kill_cold"]["bitwise"] and cluster["kill_warm"]["bitwise"])) else 1


if __name__ == "__main__":
    sys.exit(main())
