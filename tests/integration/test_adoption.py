"""A new leader adopts the jobs of a lost leader, and clients follow them there (no operator).

The first tests run real etcd and real processes: the leader coordinator is SIGKILLed
mid-job, or SIGSTOPped until a standby leads and then woken; the job must finish under
the new leader with the reference digest, nobody resumes it, and a woken deposed leader
hands its executor off without failing the job or writing. The last ones check the job
service's registry, adoption scan and fan-out on their own (tests/fakes_service.py: a stand-in
executor, a :class:`~tests.fakes.MemoryStore`).
"""

from __future__ import annotations

import json
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from rallypoint.chaos.runner import LeaseHistory
from rallypoint.client.compile import CompiledProgram
from rallypoint.client.submission import submit
from rallypoint.cluster.local import LocalCluster
from rallypoint.basics.tls import channel as tls_channel
from rallypoint.orchestrator.control.devices import DeviceLeases
from rallypoint.orchestrator.job.metrics import METRICS_FILE, read_metrics
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc
from tests.conftest import read_events, wait_until
from tests.fakes_service import Aborted, Context, StandInExecutor, looked_at_the_term, saved_run, service_with_stand_ins
from tests.helpers.cluster import assert_settled, job_record, leader, pipeline_and_digest

STEPS = 24
EVERY = 5


@pytest.fixture(scope="module")
def pipeline() -> tuple[CompiledProgram, str]:
    return pipeline_and_digest(STEPS)  # made once for the session's modules of the same pipeline


def _no_resume(lc: LocalCluster) -> None:
    for c in ("c0", "c1"):
        assert not read_events(lc.process(c).log, "job.resume_requested"), f"{c} was asked to resume the job"


def _watch(lc: LocalCluster, address: str, job: str) -> list[pb.JobEvent]:
    channel = tls_channel(address, lc.client_tls, options=[("grpc.max_receive_message_length", -1)])
    try:
        return list(pb_grpc.CoordinatorStub(channel).WatchJob(pb.WatchJobRequest(job=job), timeout=30))
    finally:
        channel.close()


def _address(lc: LocalCluster, coordinator: str) -> str:
    store = lc.store()
    try:
        kv = store.get(lc.keys.leader)
        assert kv is not None and kv.json()["coordinator"] == coordinator
        return str(kv.json()["address"])
    finally:
        store.close()


def test_leader_killed_mid_job_the_new_leader_adopts_it_and_it_finishes_bitwise_equal_without_resume(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    job = compiled.program.name
    lc = local_cluster(workers=4, spares=0, devices_per_worker=1, coordinators=2)
    old, old_term = wait_until(lambda: leader(lc), 10, "a leader")
    events: list[pb.JobEvent] = []
    steps: list[int] = []
    killed: list[float] = []

    def on_event(ev: pb.JobEvent) -> None:
        events.append(ev)
        if ev.event == "step.done" and ev.step == 12 and not killed:
            killed.append(time.monotonic())
            lc.signal(old, signal.SIGKILL)

    result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=EVERY,
                    on_event=on_event, on_step=lambda s, _m: steps.append(s))
    assert killed, "the leader was never killed"
    assert result.state_digest == reference
    new, new_term = wait_until(lambda: leader(lc), 10, "a leader")
    assert new != old and new_term > old_term
    names = [e.event for e in events]
    assert "job.resumed" not in names
    watching = [json.loads(e.detail) for e in events if e.event == "job.watching"]
    assert watching and watching[-1]["adopted"] is True, names
    assert len(steps) == len(set(steps)), "on_step reported a step twice"
    adopting = read_events(lc.process(new).log, "job.adopting")
    assert [a["job"] for a in adopting] == [job] and adopting[0]["old_term"] == old_term
    _no_resume(lc)
    rec = job_record(lc, job)
    assert rec["state"] == "succeeded" and rec["term"] == new_term and rec["step_done"] == STEPS
    assert_settled(lc)
    # Both leaders wrote the run's metrics.jsonl, the adoption marked at the cut it went on from. The workers keep
    # committing cuts while no leader listens, so that cut may lie past the step of the kill. The steps whose
    # instances completed while no leader listened (after the old leader's last line, which it wrote before it sent
    # step 12 to this client, and before the adopting one heard the workers) reached no coordinator and have no
    # line: one run of steps at most, no longer than the grant lets the workers run alone (docs/metrics.md).
    kept = read_metrics(Path(rec["run_dir"]) / METRICS_FILE)
    adopted = [m for m in kept.marks if m["event"] == "adopted"]
    assert len(adopted) == 1 and adopted[0]["step"] % EVERY == 0 and adopted[0]["step"] < STEPS, kept.marks
    missing = sorted(set(range(STEPS)) - set(kept.steps))
    assert not missing or (missing == list(range(missing[0], missing[-1] + 1)) and missing[0] > 12
                           and len(missing) <= 4), (missing, kept.marks)
    assert set(kept.steps) <= set(range(STEPS)) and len(kept.curve("loss")) == len(kept.steps)
    assert {0, 1, STEPS - 1} <= set(kept.steps)
    # Whoever asks the new leader after the end still gets it; an unknown job or a standby says so.
    address = _address(lc, new)
    seen = _watch(lc, address, job)
    assert [e.event for e in seen] == ["job.watching", "job.finished"]
    with pytest.raises(grpc.RpcError) as err:
        _watch(lc, address, "nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no job 'nope'" in (err.value.details() or "")


def test_hung_leader_is_deposed_its_executor_hands_off_without_writing_and_the_job_finishes_under_the_new_one(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    job = compiled.program.name
    lc = local_cluster(workers=4, spares=0, devices_per_worker=1, coordinators=2)
    old, old_term = wait_until(lambda: leader(lc), 10, "a leader")
    jobs_history = LeaseHistory(lc.endpoints, lc.keys.jobs)
    leases_history = LeaseHistory(lc.endpoints, lc.keys.leases)
    stopped: list[float] = []
    woke: list[tuple[str, int]] = []
    errors: list[BaseException] = []

    def wake() -> None:
        try:
            # Woken the moment the standby leads: while it adopts and runs the job, the old
            # leader's executor still believes it runs the job, with runtimes and device leases.
            woke.append(wait_until(lambda: (x := leader(lc)) and x[0] != old and x, 20, "the standby leads"))
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)
        finally:
            lc.signal(old, signal.SIGCONT)

    def on_event(ev: pb.JobEvent) -> None:
        if ev.event == "step.done" and ev.step == 10 and not stopped:
            stopped.append(time.monotonic())
            lc.signal(old, signal.SIGSTOP)
            threading.Thread(target=wake, daemon=True).start()

    try:
        result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, checkpoint_every=EVERY,
                        on_event=on_event)
    finally:
        if stopped and not woke:
            lc.signal(old, signal.SIGCONT)
    assert not errors, errors
    assert result.state_digest == reference
    (new, new_term), = woke
    assert new_term > old_term
    old_log = lc.process(old).log
    handed = wait_until(lambda: read_events(old_log, "job.handed_off"), 20, "the old leader's executor hands off")
    assert handed[0]["job"] == job
    assert not read_events(old_log, "job.failed"), "the deposed leader failed the job"
    assert read_events(lc.process(new).log, "job.adopting")
    _no_resume(lc)
    rec = job_record(lc, job)
    assert rec["state"] == "succeeded" and rec["term"] == new_term
    _catch_up(lc, job, jobs_history, leases_history)
    jobs_history.close()
    leases_history.close()
    # Nothing of the old term was written once the new term began.
    stale = [(e.kv.key, e.kv.mod_revision) for h in (jobs_history, leases_history) for e in h.events
             if e.type == "put" and e.kv.mod_revision > new_term and not e.kv.key.count("/checkpoints/")
             and json.loads(e.kv.value).get("term") == old_term]
    assert not stale, stale
    assert leader(lc) == (new, new_term), "leadership changed hands again"
    assert_settled(lc)


def _catch_up(lc: LocalCluster, job: str, jobs: LeaseHistory, leases: LeaseHistory) -> None:
    """Wait until both histories hold every change made so far: write in each prefix (the finished job's record
    again, unchanged; a device lease taken and given back) and wait for those writes, since a watch delivers
    in revision order."""
    store = lc.store()
    try:
        kv = store.get(lc.keys.job(job))
        assert kv is not None
        rev = store.put(lc.keys.job(job), kv.value)
        devices = DeviceLeases(store, lc.keys)
        taken = devices.allocate("history-catch-up", "s", 1)
        assert devices.release("history-catch-up") == 1
    finally:
        store.close()
    wait_until(lambda: any(e.kv.mod_revision >= rev for e in jobs.events), 10, "the job history to catch up")
    wait_until(lambda: any(e.type == "delete" and e.kv.mod_revision > taken.revision for e in leases.events), 10,
               "the lease history to catch up")


# -- the job service on its own -------------------------------------------------------------------------


def test_a_new_leader_adopts_every_unfinished_job_and_skips_the_rest(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    svc, c = service_with_stand_ins(monkeypatch, tmp_path)
    rd = saved_run(tmp_path, "a")
    records = {"a": {"state": "running", "term": 3, "run_dir": str(rd)},
               "b": {"state": "succeeded", "term": 3, "run_dir": str(rd)},
               "c": {"state": "recovering", "term": 3, "run_dir": ""}}
    for job, r in records.items():
        c.store.put(c.keys.job(job), json.dumps({"job": job, **r}))
    c.store.put(c.keys.checkpoint("a", "s0", 5), json.dumps({"step": 5}))
    before = {kv.key: kv.mod_revision for kv in c.store.get_prefix(c.keys.jobs)[0]}
    svc.adoption.adopt_all(7)
    (x,) = StandInExecutor.made
    assert x.spec.job == "a" and x.adopted and x.resume and x.checkpoint_root == str(tmp_path)
    assert {kv.key: kv.mod_revision for kv in c.store.get_prefix(c.keys.jobs)[0]} == before  # "c": nothing written
    svc.adoption.adopt_all(7)  # it runs here under this term: not again
    assert len(StandInExecutor.made) == 1
    # A watcher gets job.watching (adopted), then the events to the end.
    ctx = Context()
    out: queue.Queue[pb.JobEvent] = queue.Queue()
    t = threading.Thread(target=lambda: [out.put(e) for e in svc.WatchJob(pb.WatchJobRequest(job="a"), ctx)])
    t.start()
    first = out.get(timeout=5)
    assert first.event == "job.watching" and json.loads(first.detail)["adopted"] is True
    x.go.set()
    t.join(timeout=5)
    assert [out.get_nowait().event for _ in range(out.qsize())][-1] == "job.finished"
    with pytest.raises(Aborted) as err:
        list(svc.WatchJob(pb.WatchJobRequest(job="c"), Context()))
    assert err.value.code is grpc.StatusCode.NOT_FOUND and "without checkpoints" in err.value.details


def test_step_down_hands_every_job_off_once_the_term_is_over(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    svc, c = service_with_stand_ins(monkeypatch, tmp_path)
    stream = svc.SubmitJob(pb.JobSpec(job="j", steps=2), Context())
    assert next(stream).event == "job.placed"
    (x,) = StandInExecutor.made
    with pytest.raises(Aborted) as err:
        next(svc.SubmitJob(pb.JobSpec(job="j", steps=2), Context()))
    assert err.value.code is grpc.StatusCode.ALREADY_EXISTS
    # Only the local deadline passed: the lease is kept and the term may come back; it does.
    c.election.term, c.election.is_leader = None, False
    since = len(c.election.readers)
    svc.on_step_down("no keepalive acknowledged within the lease TTL")
    waiting = wait_until(lambda: looked_at_the_term(c.election, since), 5, "the service to wait for the term")
    assert x.stopped is None
    c.election.term = 7
    waiting.join(5)
    assert not waiting.is_alive() and x.stopped is None  # the same term leads again: the executor goes on
    c.election.term = None
    since = len(c.election.readers)
    svc.on_step_down("no keepalive acknowledged within the lease TTL")  # again, and this time the lease is lost
    wait_until(lambda: looked_at_the_term(c.election, since), 5, "the service to wait for the term")
    assert x.stopped is None  # the lease may still come back: nothing is handed off yet
    c.election.keeper.fence.dead = True
    wait_until(lambda: x.stopped, 5, "the executor is stopped once the term is over")
    assert next(stream).event == "job.handed_off"
    with pytest.raises(StopIteration):
        next(stream)
    # Deposed (etcd refused a write: the lease is revoked): every executor is stopped at once.
    c.election.term, c.election.is_leader, c.election.keeper = 7, True, SimpleNamespace(fence=SimpleNamespace(dead=False))
    stream = svc.SubmitJob(pb.JobSpec(job="k", steps=2), Context())
    assert next(stream).event == "job.placed"
    c.election.term, c.election.is_leader, c.election.keeper = None, False, None
    svc.on_step_down("write refused: leader key belongs to another term")
    assert "write refused" in (StandInExecutor.made[-1].stopped or "")
    assert next(stream).event == "job.handed_off"
    with pytest.raises(Aborted) as err:
        next(svc.WatchJob(pb.WatchJobRequest(job="k"), Context()))
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION and "does not lead" in err.value.details
