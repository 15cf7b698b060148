"""Recovery on a real local cluster: real etcd, real worker processes, real SIGKILLs.

Every test kills workers while the 4-stage pipeline trains and checks that the job
ends in bitwise the state of the fault-free reference (the state digest), and what
re-ran (instances counted per node by the executor).
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
import pytest

from rallypoint.client.compile import CompiledProgram
from rallypoint.client.commands.faults import Fault, FaultInjector
from rallypoint.client import submission as submit_module
from rallypoint.client.submission import JobError, submit
from rallypoint.basics.clock import SystemClock
from rallypoint.basics.errors import StoreError
from rallypoint.basics.retry import retrying
from rallypoint.etcd.commits import consistent_cut, read_commits
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig
from rallypoint.proto import rallypoint_pb2 as pb
from tests.conftest import stop_cluster, wait_until
from tests.examples import example
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.workers.checkpoints.checksums import commit_binding, state_checksum
from rallypoint.workers.faults import WorkerFaults
from tests.helpers.checkpoints import largest_file
from tests.helpers.cli import rp
from tests.helpers.cluster import EACH_KIND_OF_SLICE, EVERY, SLICES, STEPS, assert_settled, nodes_of, run


@pytest.mark.parametrize("victim", EACH_KIND_OF_SLICE)
def test_killing_the_worker_of_each_slice_at_a_random_step_ends_bitwise_equal_and_replays_only_that_slice(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str], victim: str,
) -> None:
    compiled, reference = pipeline
    step = random.Random(f"kill-{victim}").randint(3, STEPS - 4)
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=1)
    started: list[dict[str, Any]] = []
    result, injector = run(lc, compiled, [Fault(victim, victim, step)], on_event=lambda ev: started.append(
        json.loads(ev.detail)) if ev.event == "job.started" else None)
    why = f"SIGKILL of {victim} at step {step}"
    assert result.state_digest == reference, why
    # The default window is the leader's: one checkpoint interval, wider than the old constant 2.
    window = started[0]["window"]
    assert started[0]["auto"] and window == EVERY > 2, started
    rec = result.recovery
    assert [f["slices"] for f in rec["failures"]] == [[victim]], why
    (r,) = rec["recoveries"]
    assert r["policy"] == "partial" and not r["escalated"]
    assert r["checkpoint_step"] % EVERY == 0 and r["checkpoint_step"] <= step
    assert set(r["moved"]) == {victim} and r["moved"][victim] not in {injector.fired[0]["worker"]}
    # Only the lost slice's nodes re-ran, each at most its instances since the checkpoint.
    replayed = rec["replayed_instances"]
    assert set(replayed) <= nodes_of(compiled, victim), why
    assert set(r["replay_nodes"]) == nodes_of(compiled, victim)
    for node, count in replayed.items():
        # The plan counts up to the first instance not reported done; the lost worker may also have run
        # instances of the next steps of the window out of order, which re-run too.
        per_step = 4 if compiled.program.nodes[node].per == "microbatch" else 1
        assert count <= r["planned_instances"].get(node, 0) + window * per_step, (node, count, r["planned_instances"])
    assert set(r["phases"]) == {"detection", "fencing", "remap", "restore", "replay", "catch_up"}
    assert r["mttr_s"] is not None and r["mttr_s"] > 0
    # The operator's view says the same.
    status = json.loads(rp("status", "--json", "--cluster", f"{lc.keys.cluster}@{lc.endpoints[0]}",
                           "--tls-dir", str(lc.tls_dir),
                           compiled.program.name).stdout)
    assert status["state"] == "succeeded" and status["step_done"] == STEPS
    assert status["placement"][victim]["worker"] == r["moved"][victim]
    assert [f["worker"] for f in status["failures"]] == [injector.fired[0]["worker"]]
    assert status["recoveries"][0]["checkpoint_step"] == r["checkpoint_step"]
    assert set(status["last_commits"]) == set(SLICES)
    # The checkpoints are plain Orbax (docs/checkpoints.md): a surviving slice's newest commit loads with
    # Orbax alone and matches its checksum; retention kept the cut and at most keep_checkpoints (3) besides.
    survivor = next(s for s in SLICES if s != victim)
    commit = status["last_commits"][survivor]
    slice_dir = Path(commit["path"]).parent
    mngr = ocp.CheckpointManager(slice_dir, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        loaded = mngr.restore(commit["step"], args=ocp.args.StandardRestore())
        on_disk = list(mngr.all_steps())
    finally:
        mngr.close()
    named = CheckpointCommit(compiled.program.name, survivor, commit["step"], commit["path"], commit["checksum"])
    assert state_checksum(loaded, commit_binding(named)) == commit["checksum"]  # bound to job, run, slice, step
    assert status["consistent_cut"] in on_disk and len(on_disk) <= 4, on_disk
    assert_settled(lc)


def test_restart_all_reruns_every_node_from_the_cut_and_ends_bitwise_equal(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=1)
    result, _ = run(lc, compiled, [Fault("stage1", "stage1", 13)], policy="restart-all")
    assert result.state_digest == reference
    (r,) = result.recovery["recoveries"]
    assert r["policy"] == "restart-all"
    assert set(r["replay_nodes"]) == set(compiled.program.nodes)
    # Every slice re-ran something, not only the lost one.
    slices_replayed = {compiled.program.nodes[n].slice for n in result.recovery["replayed_instances"]}
    assert slices_replayed == set(SLICES)


def test_two_workers_killed_at_once_recover_together(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    lc = local_cluster(workers=4, spares=2, devices_per_worker=1, coordinators=1)
    result, _ = run(lc, compiled, [Fault("stage1", "stage1", 11), Fault("stage3", "stage3", 11)])
    assert result.state_digest == reference
    lost = {s for r in result.recovery["recoveries"] for ss in r["lost"].values() for s in ss}
    assert lost == {"stage1", "stage3"}
    assert set(result.recovery["replayed_instances"]) <= nodes_of(compiled, "stage1") | nodes_of(compiled, "stage3")
    assert_settled(lc)


def test_a_spare_killed_during_the_recovery_and_the_replacement_killed_during_replay(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    """Kill the spare the moment recovery starts (it is still registered: remap may
    pick it and LoadJob then fails), then kill whichever worker took the slice."""
    compiled, reference = pipeline
    lc = local_cluster(workers=4, spares=3, devices_per_worker=1, coordinators=1)
    killed_spare: list[str] = []
    second: list[str] = []

    def on_event(ev: pb.JobEvent) -> None:
        detail = json.loads(ev.detail or "{}")
        if ev.event == "job.recovering" and not killed_spare:
            killed_spare.append("w4")
            lc.signal("w4", signal.SIGKILL)
        elif ev.event == "job.recovered" and detail["recovery"] == 1:
            second.append(detail["moved"]["stage2"])
            lc.signal(second[0], signal.SIGKILL)

    result, _ = run(lc, compiled, [Fault("stage2", "stage2", 8)], on_event=on_event)
    assert result.state_digest == reference
    recs = result.recovery["recoveries"]
    assert len(recs) >= 2
    assert second[0] in recs[1]["lost"], recs
    assert recs[-1]["moved"]["stage2"] not in {"w2", "w4", second[0]}
    assert set(result.recovery["replayed_instances"]) <= nodes_of(compiled, "stage2")


def test_no_spare_and_on_no_spare_fail_fails_the_job_naming_the_slice(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, _ = pipeline
    lc = local_cluster(workers=4, spares=0, devices_per_worker=1, coordinators=1)
    with pytest.raises(JobError, match=r"lost slice 'stage2' \(1 devices\) finds no live, uncordoned worker.*"
                                       r"on_no_spare='fail'"):
        run(lc, compiled, [Fault("stage2", "stage2", 6)], on_no_spare="fail")
    store = lc.store()
    try:
        record = store.get(lc.keys.job(compiled.program.name)).json()
        assert record["state"] == "failed" and "stage2" in record["reason"]
        assert [f["slices"] for f in record["failures"]] == [["stage2"]]
    finally:
        store.close()
    assert_settled(lc)


def test_no_spare_waits_says_why_and_goes_on_when_a_worker_joins(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    lc = local_cluster(workers=4, spares=0, devices_per_worker=1, coordinators=1)
    waiting: list[dict[str, Any]] = []

    def on_event(ev: pb.JobEvent) -> None:
        if ev.event == "job.waiting":
            waiting.append(json.loads(ev.detail))
            threading.Thread(target=lc.spawn, args=("worker", "late")).start()

    result, _ = run(lc, compiled, [Fault("stage0", "stage0", 7)], on_event=on_event, wait_timeout_s=120)
    assert result.state_digest == reference
    assert waiting and waiting[0]["missing"] == {"stage0": 1} and "waiting up to 120s" in waiting[0]["reason"]
    assert result.recovery["recoveries"][0]["moved"] == {"stage0": "late"}


def test_no_spare_within_the_wait_timeout_fails_with_the_reason(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, _ = pipeline
    lc = local_cluster(workers=4, spares=0, devices_per_worker=1, coordinators=1)
    with pytest.raises(JobError, match=r"waited \d+ s of wait_timeout_s=1.*raise wait_timeout_s"):
        run(lc, compiled, [Fault("stage3", "stage3", 5)], wait_timeout_s=1)


def test_a_kill_while_a_checkpoint_is_saved_but_not_committed_restores_the_previous_commit(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    """Commits wait 3 s after Orbax finalized: the kill at step 12 lands while the
    checkpoint at step 10 is on disk and does not count; recovery uses an older cut
    (step 5's commit, or the inits when that one is still waiting too)."""
    compiled, reference = pipeline
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=1,
                       worker_faults=WorkerFaults(commit_delay_s=3))
    seen_on_disk: list[bool] = []

    def on_event(ev: pb.JobEvent) -> None:
        if ev.event == "job.recovering":
            store = lc.store()
            try:
                run_dir = Path(store.get(lc.keys.job(compiled.program.name)).json()["run_dir"])
            finally:
                store.close()
            # Finalized (<writer>/10/) or still being written by Orbax (<writer>/10.orbax-checkpoint-tmp*): not committed.
            seen_on_disk.append(any((run_dir / "stage1").glob("*/10*")))

    result, _ = run(lc, compiled, [Fault("stage1", "stage1", 12)], on_event=on_event)
    assert result.state_digest == reference
    (r,) = result.recovery["recoveries"]
    assert r["checkpoint_step"] in (0, 5), r
    assert seen_on_disk == [True], "the uncommitted save of step 10 should have been on disk"


def test_a_corrupt_checkpoint_at_the_cut_is_reported_and_an_older_cut_is_used(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    # The in-memory copies are damaged too (a sound one would be restored instead: test_memory_tier.py).
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=1,
                       worker_faults=WorkerFaults(corrupt_replicas=True))
    corrupted: list[int] = []
    injector_box: list[FaultInjector] = []

    def on_event(ev: pb.JobEvent) -> None:
        # Once every slice has committed step 10, stage2's worker is stopped (it commits nothing more), every
        # commit of stage2 at or past 10 is damaged, and the worker is killed: whatever the cut is by then (10,
        # or 15 where the job ran ahead), its stage2 checkpoint fails its checksum.
        if ev.event == "step.done" and ev.step == 11 and not corrupted:
            store = lc.store()  # one connection for the polls: a TLS handshake each 20 ms failed on a loaded host

            def cut_reached() -> bool:
                try:
                    return consistent_cut(read_commits(store, lc.keys, compiled.program.name), SLICES) >= 10
                except StoreError:
                    return False  # etcd busy: ask again

            try:
                wait_until(cut_reached, 20, "every slice's commit at step 10", interval_s=0.02)
                injector = injector_box[0]
                os.kill(lc.process(injector.placement["stage2"]).pid, signal.SIGSTOP)
                commits = retrying(clock=SystemClock(), what="reading the commits", stop_after_s=10.0)(
                    read_commits, store, lc.keys, compiled.program.name)
            finally:
                store.close()
            # Every save of stage2 at or past step 10 that is finalized on disk: a commit follows its save's
            # finalization, so this takes in a commit the worker had sent but etcd had not yet applied.
            slice_dir = Path(commits["stage2"][-1].path).parent
            for step in ocp.path.step.checkpoint_steps(slice_dir):
                if step >= 10:
                    f = largest_file(slice_dir / str(step))
                    data = bytearray(f.read_bytes())
                    data[len(data) // 2: len(data) // 2 + 64] = b"\x5a" * 64
                    f.write_bytes(bytes(data))
                    corrupted.append(step)
            assert {c.step for c in commits["stage2"] if c.step >= 10} <= set(corrupted), (commits, corrupted)
            injector.kill(Fault("stage2", "stage2", 12), 12)  # SIGKILL ends a stopped process too

    injector = FaultInjector([], lc.endpoints, lc.keys.cluster)
    injector_box.append(injector)

    def both(ev: pb.JobEvent) -> None:
        injector.on_event(ev)
        on_event(ev)

    result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, on_event=both, checkpoint_every=EVERY)
    assert result.state_digest == reference
    r = result.recovery["recoveries"][-1]
    assert corrupted and r["checkpoint_step"] < min(corrupted), (r, corrupted)
    assert "did not restore" in r["escalated"] and "checksum" in r["escalated"]


def test_whole_cluster_loss_then_resume_finishes_bitwise_equal(
    tmp_path: Path, pipeline: tuple[CompiledProgram, str], compile_cache: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGKILL every process of the cluster (etcd, coordinator, workers) mid-job; a new
    cluster on the same state dir (a fresh etcd: the commits come from their copies
    beside the checkpoints) resumes the job from the newest consistent cut."""
    compiled, reference = pipeline
    # The client that lost the whole cluster gives up once etcd stayed away for etcd_wait_s (15 s by default,
    # for a cluster that may come back): 1 s here, where nothing comes back until the test restarts it.
    monkeypatch.setattr(submit_module, "JobFollower", functools.partial(submit_module.JobFollower, etcd_wait_s=1.0))
    config = LocalClusterConfig(state_dir=tmp_path / "cluster", workers=4, spares=0, devices_per_worker=1,
                                coordinators=1, compile_cache_dir=compile_cache)
    lc = LocalCluster.start(config)
    try:
        def on_event(ev: pb.JobEvent) -> None:
            if ev.event == "step.done" and ev.step == 15:
                for p in lc.processes:
                    try:
                        os.kill(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

        with pytest.raises(JobError, match="etcd stayed unreachable"):
            submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, on_event=on_event,
                   checkpoint_every=EVERY)
    finally:
        lc.stop()
    monkeypatch.undo()  # the resumed run and the runs after it follow with the defaults
    lc2 = LocalCluster.start(config)
    try:
        out = rp("resume", "--json", "--state-dir", str(config.state_dir), compiled.program.name, timeout=300)
        lines = [json.loads(x) for x in out.stdout.splitlines()]
        resumed = next(x for x in lines if x["event"] == "job.resumed")
        assert resumed["step"] in (10, 15)
        assert [x["step"] for x in lines if x["event"] == "step"] == list(range(resumed["step"], STEPS))
        assert lines[-1]["event"] == "job.finished" and lines[-1]["state_digest"] == reference
        assert lines[-1]["start_step"] == resumed["step"]
        _a_resubmit_is_refused_and_a_new_run_keeps_the_old_one(lc2, compiled, reference)
    finally:
        stop_cluster(lc2)


def _a_resubmit_is_refused_and_a_new_run_keeps_the_old_one(lc: LocalCluster, compiled: CompiledProgram,
                                                           reference: str) -> None:
    """On the resumed job's cluster: submitting the name again is refused (nothing changed in etcd
    or on disk); with new_run it runs, and the old run's commits and files stay under its run id."""
    job = compiled.program.name
    root = lc.checkpoint_dir / job
    store = lc.store()
    try:
        old = store.get(lc.keys.job(job)).json()
        before = ({kv.key: kv.mod_revision for kv in store.get_prefix(lc.keys.prefix + "jobs/")[0]},
                  sorted(str(p) for p in root.rglob("*")))
        with pytest.raises(JobError, match="FAILED_PRECONDITION") as err:
            submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=EVERY)
        assert f"rallypoint resume {job}" in str(err.value) and "--new-run" in str(err.value)
        assert old["run"] and old["run"] in str(err.value)
        assert ({kv.key: kv.mod_revision for kv in store.get_prefix(lc.keys.prefix + "jobs/")[0]},
                sorted(str(p) for p in root.rglob("*"))) == before
        old_commits = {kv.key.split("/checkpoints/")[1]: kv.value for kv in store.get_prefix(lc.keys.checkpoints(job))[0]}
        result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=EVERY, new_run=True)
        assert result.state_digest == reference
        new = store.get(lc.keys.job(job)).json()
        assert new["run"] != old["run"] and new["state"] == "succeeded"
        kept = {kv.key.split("/checkpoints/")[1]: kv.value
                for kv in store.get_prefix(lc.keys.old_run_checkpoints(job, old["run"]))[0]}
        assert kept == old_commits and kept  # the old run's commits, under its run id
        assert all(Path(c.path).is_relative_to(new["run_dir"])
                   for cs in read_commits(store, lc.keys, job).values() for c in cs)
        assert (root / old["run"]).is_dir() and (root / "LATEST").read_text().strip() == new["run"]
    finally:
        store.close()


def test_the_readme_quick_start_recovers_from_its_kill(tmp_path: Path) -> None:
    """The README's quick start, as written (`rallypoint run examples/pipeline_mlp.py --fail kill:stage2@12`, read
    from README.md; --json added to read its events): the embedded cluster every `rallypoint run` without --cluster
    starts, each step once, in order, then the reference's digest, the fault and the recovery in between; once its
    cluster is gone, `rallypoint plot` draws the run from the metrics it kept. (That `rallypoint run --reference`
    prints the in-process reference's digest: tests/client/test_run_cli.py.)"""
    from matplotlib import image

    from rallypoint.client.reference import run_reference
    from tests.docs.markdown import quick_start_export, quick_start_run

    args = quick_start_run()
    assert args[:2] == ["run", "examples/pipeline_mlp.py"] and "--fail" in args, args
    job = args[1]  # relative to the repository's root, where rp runs the CLI
    state = {"RALLYPOINT_STATE_DIR": str(tmp_path / "state")}  # where the run is kept (STATE_DIR/runs)
    board = tmp_path / "tb"  # the trackers: TensorBoard event files the leading coordinator writes
    out = rp(*args, "--json", "--tensorboard", str(board), timeout=300, env=state)
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    kinds = [x["event"] for x in lines if x["event"] != "step"]
    assert kinds == ["fault.injected", "job.recovering", "job.recovered", "job.finished"], kinds
    steps = example("pipeline_mlp").build().steps
    noise = [x for x in out.stderr.splitlines() if "absl" in x or "orbax" in x.lower()]  # the cluster's log files'
    assert not noise, noise[:3]
    assert [x["step"] for x in lines if x["event"] == "step"] == list(range(steps))
    final = lines[-1]
    assert final["steps"] == steps
    assert final["state_digest"] == run_reference(example("pipeline_mlp").build()).state_digest
    assert [f["slices"] for f in final["failures"]] == [["stage2"]]
    assert final["recoveries"][0]["checkpoint_step"] in (0, 10)
    assert set(final["replayed_instances"]) <= {"fwd2", "bwd2", "update2"}
    runs = tmp_path / "state" / "runs" / "pipeline-mlp"  # the run outlives its embedded cluster, its final cut in it
    run = runs / (runs / "LATEST").read_text().strip()
    assert {p.parent.name for p in (run / "commits").glob(f"*/{steps:012d}.json")} == \
        {f"stage{i}" for i in range(4)}, "every slice's final state committed at the last step"
    assert (run / "metrics.jsonl").is_file() and (run / "events.jsonl").is_file() and (run / "jobspec.pb").is_file()
    export = quick_start_export()  # its weights on disk: the final cut, as a plain Orbax checkpoint
    assert export[:2] == ["export", "pipeline-mlp"] and "--out" in export, export
    out = tmp_path / "weights"
    export[export.index("--out") + 1] = str(out)
    rp(*export, env=state)
    manifest = json.loads((out / "rallypoint-export.json").read_text())
    assert manifest["step"] == steps and manifest["run"] == run.name and (out / str(steps) / "default").is_dir()
    png = tmp_path / "loss.png"
    drawn = rp("plot", "pipeline-mlp", "--out", str(png), env=state).stdout
    assert drawn.startswith(f"{png}: {steps} steps (0..{steps - 1}), loss "), drawn
    assert drawn.endswith(", 1 recovery\n"), drawn
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.imread(png).size > 0
    bad = rp("run", "--fail", "kill:stage9@3", job, check=False)
    assert bad.returncode == 1 and "'stage9' is neither a slice" in bad.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_board,) = (board / "pipeline-mlp").iterdir()  # DIR/<job>/<run id>
    acc = EventAccumulator(str(run_board), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == list(range(steps))  # every step once, replayed ones too
    (lost,) = acc.Scalars("rallypoint/lost_workers")
    assert lost.value == 1.0 and [e.step for e in acc.Scalars("rallypoint/recovery_mttr_s")] == [lost.step]
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("rallypoint/events")]
    assert any(t.startswith(f"step {lost.step}: lost ") for t in texts), texts
    assert any(f"replayed from step {final['recoveries'][0]['checkpoint_step']}, MTTR" in t for t in texts), texts
