"""A job's whole life on a real local cluster: submit and walk away, watch, suspend, resume, cancel, the history
and the event log; a suspend during a recovery, a cancel during a drain, a watch across a leader kill, a
higher-priority job that suspends a lower one which resumes by itself; and the bad inputs, each refused with
nothing changed. One cluster serves the module (its start costs more than most of these tests)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from rallypoint.cli import main as cli_main
from rallypoint.client.compile import CompiledProgram, compile_program
from rallypoint.client.lifecycle import control, submit_detached, watch
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.submission import JobStoppedError, resume
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig, is_running
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.proto import rallypoint_pb2 as pb
from tests.conftest import stop_cluster, wait_until
from tests.examples import example
from tests.helpers.cluster import cluster_args, counter_job

pytestmark = pytest.mark.processes

STEPS = 40
LONG = 200
WATCHED = 300  # the watch across a leader kill: the job must still run when the leader is killed
EVERY = 5
QUIET = {"warm_spares": 0, "checkpoint_every": EVERY}  # no spare compiles beside the job: this machine has 2 cores
CALLER = "operator:client"  # a stop's `by`: the caller's certificate (the CLI of the embedded cluster)


@pytest.fixture(scope="module")
def lc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster.start(LocalClusterConfig(
        state_dir=tmp_path_factory.mktemp("lifecycle"), workers=4, spares=1, devices_per_worker=1, coordinators=2,
        lease_ttl_s=2, compile_cache_dir=tmp_path_factory.getbasetemp() / "lifecycle-compile-cache"))
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


@pytest.fixture(scope="module")
def pipeline() -> tuple[CompiledProgram, str]:
    compiled = compile_program(example("pipeline_mlp").build(steps=STEPS))
    return compiled, ReferenceExecutor(compiled).run().state_digest


def where(lc: LocalCluster) -> dict[str, Any]:
    return {"endpoints": lc.endpoints, "cluster": lc.keys.cluster}


def record(lc: LocalCluster, job: str) -> dict[str, Any]:
    store = lc.store()
    try:
        kv = store.get(lc.keys.job(job))
        return kv.json() if kv is not None else {}
    finally:
        store.close()


def held(lc: LocalCluster, job: str) -> int:
    store = lc.store()
    try:
        return sum(h.job == job for w in read_cluster(store, lc.keys).workers.values() for h in w.holders.values())
    finally:
        store.close()


def cli(lc: LocalCluster, *args: str) -> Any:
    """``rallypoint ARGS --cluster ...`` in this process (the CLI's code, without a new interpreter's start)."""
    verb, rest = args[0], list(args[1:])
    return CliRunner().invoke(cli_main, [verb, *cluster_args(lc), *rest], catch_exceptions=False)


def until_step(lc: LocalCluster, job: str, step: int) -> None:
    wait_until(lambda: int(record(lc, job).get("step_done") or 0) >= step or record(lc, job).get("state") not in
               ("placing", "loading", "running", "recovering", "stopping"), 60, f"{job} at step {step}", 0.1)


def test_a_detached_job_is_suspended_listed_resumed_with_nothing_replayed_and_logged(
    lc: LocalCluster, pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    got = submit_detached(compiled, **where(lc), **QUIET)
    job, run = got["job"], got["run"]
    assert run.startswith("run-") and set(got["placement"]) == {"stage0", "stage1", "stage2", "stage3"}
    again = submit_detached(compiled, submit_id=got["submit_id"], **where(lc), **QUIET)  # a retried submit
    assert again["run"] == run  # followed the run it started: no second run
    until_step(lc, job, 8)
    reply = control(job, "suspend", **where(lc), by="operator test", reason="maintenance")
    assert reply.state == "running" and "suspended at its next step boundary" in reply.message
    with pytest.raises(JobStoppedError) as stopped:
        watch(job, **where(lc))
    assert stopped.value.state == "suspended" and "`rallypoint resume" in str(stopped.value)
    rec = record(lc, job)
    assert rec["state"] == "suspended" and rec["cut"] == rec["step_done"] and 8 < rec["cut"] < STEPS
    assert rec["stop"]["by"] == CALLER and held(lc, job) == 0
    listed = [json.loads(line) for line in cli(lc, "jobs", "--json").output.splitlines()]
    row = next(r for r in listed if r["job"] == job and r["current"])
    assert row["state"] == "suspended" and row["run"] == run and row["stopped_by"] == CALLER
    assert [r["run"] for r in listed if r["job"] == job] == [run]  # one run: the retried submit started none
    shown = cli(lc, "watch", job)
    assert shown.exit_code == 4 and "is suspended" in shown.output
    refused = cli(lc, "suspend", job)
    assert refused.exit_code == 1 and "already suspended" in refused.output and record(lc, job) == rec

    done = resume(job, **where(lc))
    assert done["state_digest"] == reference and done["start_step"] == rec["cut"]
    assert done["replayed_instances"] == {} and done["recoveries"] == []  # nothing ran twice
    assert record(lc, job)["run"] == run and held(lc, job) == 0
    log = cli(lc, "logs", job, "--json")
    names = [json.loads(line)["event"] for line in log.output.splitlines()]
    assert names[:2] == ["job.placed", "job.started"] and names[-1] == "job.finished"
    assert names.index("job.stopping") < names.index("job.suspended") < names.index("job.resumed")
    text = cli(lc, "logs", job).output
    assert "job.suspended" in text and f"by {CALLER}: maintenance" in text


def placed_on(lc: LocalCluster, job: str, slice_name: str) -> str:
    return str(record(lc, job)["placement"][slice_name]["worker"])


def cordon(lc: LocalCluster, workers: list[str], on: bool) -> None:
    from rallypoint.orchestrator.control.devices import DeviceLeases

    store = lc.store()
    try:
        leases = DeviceLeases(store, lc.keys)
        for w in workers:
            leases.cordon(w) if on else leases.uncordon(w)
    finally:
        store.close()


def free_workers(lc: LocalCluster) -> list[str]:
    store = lc.store()
    try:
        return sorted(w for w, s in read_cluster(store, lc.keys).workers.items() if not s.holders)
    finally:
        store.close()


def respawn(lc: LocalCluster, name: str, role: str = "worker") -> None:
    lc.reap(name)
    lc.spawn(role, name)
    if role == "worker":
        lc.wait_for_workers(5)


def test_a_suspend_asked_while_a_recovery_waits_for_room_takes_effect_once_the_job_runs_again(
    lc: LocalCluster, pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    job = submit_detached(compiled, new_run=True, **where(lc), **QUIET)["job"]
    spare = free_workers(lc)
    cordon(lc, spare, True)  # the recovery has nowhere to go until the lost worker comes back
    try:
        until_step(lc, job, 8)
        victim = placed_on(lc, job, "stage1")
        lc.signal(victim, signal.SIGKILL)
        wait_until(lambda: record(lc, job).get("state") == "recovering", 30, "the recovery waiting for room", 0.1)
        reply = control(job, "suspend", **where(lc), by="operator test")
        assert reply.state == "recovering"
        time.sleep(1.0)
        assert record(lc, job)["state"] == "recovering"  # the stop waits for the recovery; nothing saved yet
        seen: list[pb.JobEvent] = []
        ended: list[BaseException] = []

        def follow() -> None:
            try:
                watch(job, on_event=seen.append, **where(lc))
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                ended.append(exc)

        watcher = threading.Thread(target=follow)
        watcher.start()  # a watch that comes while the recovery waits
        wait_until(lambda: seen, 30, "the watch's first event")
        respawn(lc, victim)  # room again: the recovery ends, then the job saves at a boundary and stops
        watcher.join(60)
        (stopped,) = ended
        assert isinstance(stopped, JobStoppedError) and stopped.state == "suspended"
    finally:
        cordon(lc, spare, False)
    rec = record(lc, job)
    assert rec["state"] == "suspended" and len(rec["recoveries"]) == 1 and rec["cut"] == rec["step_done"]
    assert held(lc, job) == 0
    before = json.loads(seen[0].detail)  # what the watch was told happened before it came
    assert seen[0].event == "job.watching" and before["state"] == "recovering"
    assert before["stop"]["by"] == CALLER and [sorted(r["lost"]) for r in before["recoveries"]] == [[victim]]
    done = resume(job, **where(lc))
    assert done["state_digest"] == reference and done["start_step"] == rec["cut"]
    assert done["replayed_instances"] == {}  # what the recovery replayed, it replayed before the suspend


def test_a_cancel_during_a_drain_lets_the_drain_finish_then_ends_cancelled_at_a_saved_cut(
    lc: LocalCluster, pipeline: tuple[CompiledProgram, str],
) -> None:
    from rallypoint.client.commands.drains import begin_drain

    compiled, reference = pipeline
    job = submit_detached(compiled, new_run=True, **where(lc), **QUIET)["job"]
    until_step(lc, job, 8)
    worker = placed_on(lc, job, "stage2")
    store = lc.store()
    try:
        begin_drain(store, lc.keys, worker, by="operator test")
        wait_until(lambda: record(lc, job).get("drains"), 30, "the drain under way", 0.05)
        reply = control(job, "cancel", checkpoint=True, **where(lc), by="operator test")
        with pytest.raises(JobStoppedError) as stopped:
            watch(job, **where(lc))
        assert stopped.value.state == "cancelled"
    finally:
        store.delete(lc.keys.drain(worker))
        store.close()
        cordon(lc, [worker], False)
    assert reply.state in ("running", "stopping")
    rec = record(lc, job)
    assert rec["state"] == "cancelled" and rec["stop"]["checkpoint"] and rec["cut"] == rec["step_done"]
    (drain,) = rec["drains"]
    assert drain["state"] == "done" and held(lc, job) == 0  # the drain ended first; then every lease went
    again = cli(lc, "cancel", job)
    assert again.exit_code == 1 and "already cancelled" in again.output and "nothing changed" in again.output
    assert record(lc, job) == rec
    done = resume(job, **where(lc))  # a cancelled run is kept: resume continues it
    assert done["state_digest"] == reference and done["start_step"] == rec["cut"] and done["replayed_instances"] == {}


@pytest.fixture(scope="module")
def long_pipeline() -> tuple[CompiledProgram, str]:
    """Long enough to outlast two CLIs' start, a Ctrl-C and a leader's kill and adoption on a loaded host (the
    suite runs on two processes: 200 steps could end before the kill)."""
    compiled = compile_program(example("pipeline_mlp").build(steps=WATCHED))
    return compiled, ReferenceExecutor(compiled).run().state_digest


def test_a_watch_follows_a_detached_job_across_a_leader_kill_and_ctrl_c_detaches_without_stopping_it(
    lc: LocalCluster, long_pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = long_pipeline
    job = submit_detached(compiled, new_run=True, **where(lc), **QUIET)["job"]
    try:
        _watch_across_a_leader_kill(lc, job, reference)
    except BaseException:  # the module's later tests need its devices and both coordinators: leave none behind
        with contextlib.suppress(Exception):
            control(job, "cancel", **where(lc))
        for p in lc.processes:
            if p.role == "coordinator" and not is_running(p):
                with contextlib.suppress(Exception):
                    respawn(lc, p.name, "coordinator")
        raise


def next_event(p: subprocess.Popen[str]) -> str:
    """The event of the next JSON line ``p`` prints; a CLI that prints none fails naming what it said instead."""
    line = p.stdout.readline()  # type: ignore[union-attr]
    if not line:
        p.wait(timeout=30)
        raise AssertionError(f"the CLI ended (exit {p.returncode}) without a line: {p.stderr.read()}")  # type: ignore[union-attr]
    return json.loads(line)["event"]


def _watch_across_a_leader_kill(lc: LocalCluster, job: str, reference: str) -> None:
    argv = [sys.executable, "-m", "rallypoint.cli", "watch", job, "--json", *cluster_args(lc)]
    # A terminal's Ctrl-C is SIGINT with Python's handler in place (a suite run in the background ignores SIGINT,
    # and its children inherit that).
    interactive = [sys.executable, "-c", "import runpy, signal, sys; signal.signal(signal.SIGINT, "
                   "signal.default_int_handler); sys.argv[0] = 'rallypoint'; runpy.run_module('rallypoint.cli', "
                   "run_name='__main__')", *argv[3:]]
    detaching = subprocess.Popen(interactive, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch_err = tempfile.TemporaryFile("w+")  # read at the end: a pipe nobody reads could fill and stall the CLI
    watching = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=watch_err, text=True)
    # Every line the watch prints, read through one reader (a readline then communicate() loses what the readline
    # buffered past its line).
    lines: list[dict[str, Any]] = []

    def read() -> None:
        for line in watching.stdout:  # type: ignore[union-attr]
            lines.append(json.loads(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # The leader is killed as soon as the watch follows the job's steps, while the job has most of its steps
        # ahead (on a loaded host, a kill after the Ctrl-C below could come after the job's end).
        wait_until(lambda: [e["event"] for e in lines][:2] == ["job.watching", "step"] or watching.poll() is not None,
                   60, "the watch's first step")
        assert [e["event"] for e in lines][:2] == ["job.watching", "step"], (lines, _text(watch_err))
        store = lc.store()
        try:
            leader = store.get(lc.keys.leader).json()["coordinator"]  # type: ignore[union-attr]
        finally:
            store.close()
        assert record(lc, job).get("state") in ("running", "recovering"), \
            f"the job ended before its leader was killed: {record(lc, job)}"
        lc.signal(leader, signal.SIGKILL)
        assert next_event(detaching) == "job.watching"
        while (event := next_event(detaching)) != "step":  # the leader's change may come first
            assert event not in ("job.finished", "job.failed", "job.cancelled", "job.suspended"), event
        detaching.send_signal(signal.SIGINT)  # Ctrl-C while it follows the job
        _out, err = detaching.communicate(timeout=30)
        assert detaching.returncode == 130 and f"detached from job {job}" in err and "it goes on" in err, err
        watching.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        for p in (detaching, watching):
            if p.poll() is None:
                p.kill()
                p.wait()
        err = _text(watch_err)
        watch_err.close()
    assert watching.returncode == 0, err
    events = [e["event"] for e in lines]
    assert events.count("job.watching") == 2, events  # followed to the new leader, which adopted it
    assert lines[-1]["event"] == "job.finished" and lines[-1]["state_digest"] == reference
    assert record(lc, job)["state"] == "succeeded"
    respawn(lc, leader, "coordinator")


def _text(f: Any) -> str:
    """What ``f`` (a temporary file a process wrote) holds."""
    f.seek(0)
    return f.read()


def counter(name: str, steps: int) -> CompiledProgram:
    return compile_program(counter_job(steps, name, EVERY))


def test_a_job_that_needs_every_device_of_a_lower_priority_one_suspends_it_and_the_lower_resumes_by_itself(
    lc: LocalCluster,
) -> None:
    from rallypoint.client.submission import submit

    low, high = counter("background", 400), counter("urgent", 60)
    low_reference = ReferenceExecutor(low).run().state_digest
    lc.wait_for_workers(5)
    others = free_workers(lc)[1:]
    cordon(lc, others, True)  # one worker is the whole pool: the urgent job needs the background job's only device
    listed: list[list[dict[str, Any]]] = []
    slow: dict[str, Any] = {}

    def slow_watcher(ev: pb.JobEvent) -> None:
        """A watcher slow to act on the suspend's end event: the leader has resumed the job before it reads on."""
        if ev.event == "job.suspended":
            wait_until(lambda: record(lc, "background").get("state") != "suspended", 120, "background resumed", 0.1)

    def watch_slowly() -> None:
        try:
            slow["end"] = watch("background", **where(lc), on_event=slow_watcher)
        except Exception as exc:  # noqa: BLE001 (the assertion below names it)
            slow["error"] = exc

    slow_watch = threading.Thread(target=watch_slowly, daemon=True)

    def on_event(ev: pb.JobEvent) -> None:
        if ev.event == "step.done" and ev.step == 1 and not listed:
            listed.append([json.loads(line) for line in cli(lc, "jobs", "--json", "--current").output.splitlines()])
            slow_watch.start()  # while the background job is suspended

    try:
        submit_detached(low, priority=0, **where(lc), **QUIET)
        until_step(lc, "background", 6)
        urgent = submit(high, priority=10, on_event=on_event, **where(lc), **QUIET)
        assert urgent.steps == 60
        (rows,) = listed
        row = {r["job"]: r for r in rows}["background"]
        assert row["state"] == "suspended" and row["stopped_by"] == "job urgent (priority 10)" and row["auto_resume"]
        assert row["devices_held"] == 0
        shown = cli(lc, "watch", "background")  # the progress bar: it waits through the suspend
        slow_watch.join(timeout=300)
    finally:
        cordon(lc, others, False)
        if record(lc, "background").get("state") not in ("succeeded", "failed", "cancelled"):
            cli(lc, "cancel", "background")  # a failure here leaves no job to the next test
    assert "error" not in slow, slow  # the end event said the leader resumes it: followed on, not "suspended"
    assert slow["end"].event == "job.finished"
    assert shown.exit_code == 0, shown.output
    assert f"job background finished: 400 steps, state digest {low_reference}" in shown.output
    assert "watching job background" in shown.output  # it followed the job, not its record
    log = [json.loads(line) for line in cli(lc, "logs", "background", "--json").output.splitlines()]
    resumed = [e for e in log if e["event"] == "job.resumed"]
    assert [e["auto"] for e in resumed] == [True] and record(lc, "background")["replayed_instances"] == {}
    assert log[-1]["event"] == "job.finished"


def test_bad_lifecycle_requests_are_refused_with_what_to_do_and_change_nothing(lc: LocalCluster) -> None:
    from rallypoint.client.submission import submit

    assert submit(counter("tiny", 6), **where(lc), **QUIET).steps == 6  # a job that is over
    store = lc.store()
    try:
        before = {kv.key: kv.mod_revision for kv in store.get_prefix(lc.keys.prefix)[0]}
    finally:
        store.close()
    for args, says in [
        (("cancel", "nosuch"), "has no job 'nosuch'"),
        (("suspend", "nosuch"), "has no job 'nosuch'"),
        (("cancel", "a/b"), "job name"),
        (("watch", "nosuch"), "has no job 'nosuch'"),
        (("logs", "nosuch"), "has no job 'nosuch'"),
        (("cancel", "tiny"), "already succeeded: there is nothing to cancel; nothing changed"),
        (("suspend", "tiny"), "already succeeded: there is nothing to suspend; nothing changed"),
        (("resume", "tiny"), "cannot resume: job 'tiny' is succeeded"),
    ]:
        out = cli(lc, *args)
        assert out.exit_code == 1 and says in out.output, (args, out.output)
    shown = cli(lc, "watch", "tiny")
    assert shown.exit_code == 0 and "is succeeded" in shown.output
    store = lc.store()
    try:
        assert {kv.key: kv.mod_revision for kv in store.get_prefix(lc.keys.prefix)[0]
                if not kv.key.startswith((lc.keys.workers, lc.keys.leader, lc.keys.prefix + "coordinators/"))} == {
            k: v for k, v in before.items()
            if not k.startswith((lc.keys.workers, lc.keys.leader, lc.keys.prefix + "coordinators/"))}
    finally:
        store.close()
    detach = CliRunner().invoke(cli_main, ["run", "examples/pipeline_mlp.py", "--detach"], catch_exceptions=False)
    assert detach.exit_code == 1 and "--detach needs --cluster" in detach.output


def test_run_detach_prints_the_run_and_a_cancel_without_a_checkpoint_stops_it_at_once(lc: LocalCluster) -> None:
    out = cli(lc, "run", "examples/pipeline_mlp.py", "--steps", str(LONG), "--detach", "--new-run", "--warm-spares", "0")
    assert out.exit_code == 0, out.output
    run = record(lc, "pipeline-mlp")["run"]
    assert f"job pipeline-mlp runs: run {run}, on stage0@" in out.output and "rallypoint watch pipeline-mlp" in out.output
    until_step(lc, "pipeline-mlp", 3)
    cancelled = cli(lc, "cancel", "pipeline-mlp", "--json")
    assert cancelled.exit_code == 0, cancelled.output
    line = json.loads(cancelled.output.splitlines()[-1])
    assert line["state"] == "cancelled" and "without a final checkpoint" in line["reason"] and line["run"] == run
    rec = record(lc, "pipeline-mlp")
    assert rec["state"] == "cancelled" and rec["step_done"] < LONG and held(lc, "pipeline-mlp") == 0
    names = [json.loads(line)["event"] for line in cli(lc, "logs", "pipeline-mlp", "--json").output.splitlines()]
    assert names[-1] == "job.cancelled" and "job.stopping" not in names  # it did not wait for a boundary
    status = cli(lc, "status", "pipeline-mlp")
    assert "cancelled" in status.output and "cancel asked by operator" in status.output
