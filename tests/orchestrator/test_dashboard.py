"""The dashboard's pure parts (JSON builders, escaping, the recorder) and its HTTP server on a free port."""

from __future__ import annotations

import http.client
import json
import re
from types import SimpleNamespace
from typing import Any

import pytest

from rallypoint.etcd.cluster_records import ClusterSnapshot, Holder, WorkerInfo, WorkerSnapshot
from rallypoint.basics.errors import ConfigError
from rallypoint.orchestrator.service.dashboard import DashboardServer, cluster_json, jobs_json, json_response, workers_json
from rallypoint.orchestrator.observe.page import PAGE
from rallypoint.orchestrator.observe.timeline import TimelineRecorder
from rallypoint.orchestrator.job.state import JobState
from rallypoint.orchestrator.job.view import JobView
from rallypoint.orchestrator.observe.metrics_svg import metrics_svg
from rallypoint.orchestrator.observe.timeline_svg import timeline_svg
from rallypoint.proto import rallypoint_pb2 as pb

EVIL = '<script>alert("x")</script>&<img src=x onerror=alert(1)>'


def info(worker: str, incarnation: int, state: str = "serving") -> WorkerInfo:
    return WorkerInfo(worker=worker, incarnation=incarnation, lease=1, address=f"127.0.0.1:{incarnation}", pid=100,
                      devices=2, state=state, record={})


def snapshot() -> ClusterSnapshot:
    held = WorkerSnapshot(info=info("w0", 7), devices=(0, 1), holders={0: Holder("job-a", "stage0", "n")},
                          cordoned=False)
    spare = WorkerSnapshot(info=info("w1", 8), devices=(0, 1), holders={}, cordoned=False)
    cordoned = WorkerSnapshot(info=info("w3", 9), devices=(0,), holders={}, cordoned=True)
    return ClusterSnapshot(revision=10, workers={"w0": held, "w1": spare, "w3": cordoned}, cordoned=frozenset({"w3"}),
                           lost={"w2": {"incarnation": 5, "reason": "connection_lost", "pid": 42, "at": 1.5},
                                 "w1": {"incarnation": 3, "reason": "old loss of a worker that came back"}})


def test_workers_json_lists_states_holders_cordons_and_lost_workers() -> None:
    rows = {r["worker"]: r for r in workers_json(snapshot())}
    assert list(rows) == ["w0", "w1", "w3", "w2"]
    assert rows["w0"]["state"] == "leased" and rows["w0"]["held_by"] == [{"job": "job-a", "slice": "stage0"}]
    assert rows["w0"]["devices"] == 2 and rows["w0"]["free"] == 1 and rows["w0"]["incarnation"] == 7
    assert rows["w1"]["state"] == "spare" and rows["w1"]["alive"]  # it came back: its old loss is not shown
    assert rows["w3"]["state"] == "cordoned" and rows["w3"]["cordoned"]
    assert rows["w2"] | {} == rows["w2"] and rows["w2"]["state"] == "lost" and not rows["w2"]["alive"]
    assert rows["w2"]["lost_reason"] == "connection_lost" and rows["w2"]["incarnation"] == 5


def recorded_job(name: str = "job-a", ended: float | None = None) -> dict[str, Any]:
    return {"job": name, "state": "running", "steps": 10, "step_done": 4, "ended_at": ended, "started_at": 100.0,
            "recoveries": [], "drains": [], "failures": [],
            "timeline": {"started_at": 100.0, "ended_at": 110.0, "job": {"steps": 10},
                         "progress": [{"t": 101.0, "node": "n", "step": 2}], "faults": [], "recoveries": []}}


def test_jobs_json_puts_recorded_jobs_first_with_their_timeline_then_the_other_records() -> None:
    records = {"job-a": {"state": "running", "steps": 10}, "job-b": {
        "state": "succeeded", "steps": 5, "step_done": 5, "priority": 2, "recoveries": [{"recovery": 1}],
        "placement": {"s0": {"worker": "w0", "devices": [0, 1]}, "s1": {"worker": "w1", "devices": [0]}}}}
    jobs = jobs_json([recorded_job()], records)
    assert [j["job"] for j in jobs] == ["job-a", "job-b"]
    assert jobs[0]["timeline_svg"].startswith("<svg") and jobs[0]["step_done"] == 4
    b = jobs[1]
    assert b["from_record"] and b["state"] == "succeeded" and b["step_done"] == 5 and b["devices_held"] == 3
    assert b["recoveries"] == [{"recovery": 1}] and b["timeline_svg"] == ""


def test_a_follower_shows_the_leader_and_no_running_job_of_its_own() -> None:
    leader = {"coordinator": "c0", "term": 4, "dashboard": "http://127.0.0.1:1/"}
    body = cluster_json(cluster="local", coordinator="c1", leading=False, leader=leader, snap=None,
                        recorded=[recorded_job("stale"), recorded_job("old", ended=105.0)], records={}, now=1.0)
    assert body["leader"] == leader and not body["leading"] and body["workers"] == []
    assert [j["job"] for j in body["jobs"]] == ["old"]
    json.dumps(body)  # plain JSON


def test_every_text_from_the_cluster_is_escaped_in_the_svg() -> None:
    summary = {"started_at": 0.0, "ended_at": 5.0, "job": {"steps": 4},
               "progress": [{"t": 1.0, "node": EVIL, "step": 1}, {"t": 2.0, "node": EVIL, "step": 2}],
               "faults": [{"kind": "lost", "target": EVIL, "at": 1.5}],
               "recoveries": [{"recovery": EVIL, "detected_at": 1.6, "mttr_s": 0.5}]}
    svg = timeline_svg(summary)
    assert "<script" not in svg and "<img" not in svg and "onerror=alert(1)>" not in svg
    assert "&lt;script&gt;" in svg and "&lt;img src=x onerror=alert(1)&gt;" in svg
    # ... and in the JSON (the page sets text with textContent; the SVG is the one markup it inserts).
    payload = json_response({"jobs": jobs_json([recorded_job() | {"job": EVIL}], {})})[2].decode()
    assert json.loads(payload)["jobs"][0]["job"] == EVIL


def test_the_page_is_self_contained_and_inserts_markup_only_for_the_svg() -> None:
    assert "<script src" not in PAGE and "<link" not in PAGE and "@import" not in PAGE and "url(" not in PAGE
    assert not re.search(r"""(src|href)=["']?https?:""", PAGE)
    assert PAGE.count("innerHTML") == 2 and "svg.innerHTML = j.timeline_svg" in PAGE
    assert "svg.innerHTML = j.metrics_svg" in PAGE
    assert "eval(" not in PAGE and "document.write" not in PAGE
    assert "/api/cluster" in PAGE and "data-recoveries" in PAGE and "data-step" in PAGE


class FakeExecutor:
    """An executor as the recorder sees it: the views it hands out (JobView), changed between events."""

    def __init__(self) -> None:
        self.completed = 0
        self.placement: dict[str, Any] = {"s0": SimpleNamespace(worker="w0", incarnation=3, devices=(0, 1))}
        self.recoveries: list[Any] = []

    def view(self) -> JobView:
        return JobView(job="j", state=JobState.RUNNING, steps=100, priority=3, completed=self.completed,
                       placement=dict(self.placement), recoveries=tuple(self.recoveries),
                       done_through={"fwd": self.completed, "bwd": max(0, self.completed - 1)})


def test_the_recorder_keeps_progress_recoveries_and_rates_bounded() -> None:
    clock = [1000.0]
    rec = TimelineRecorder(max_points=50, keep_ended=1, wall=lambda: clock[0])
    x = FakeExecutor()

    def emit(event: str, step: int = 0, **detail: Any) -> None:
        rec.observe(x.view(), pb.JobEvent(job="j", event=event, step=step, detail=json.dumps(detail)))

    emit("job.placed")
    for s in range(60):
        clock[0] += 0.2
        x.completed = s + 1
        emit("step.done", step=s)
    (j,) = rec.jobs()
    assert j["state"] == "running" and j["step_done"] == 60 and j["steps"] == 100 and j["priority"] == 3
    assert j["steps_per_s"] == pytest.approx(5.0) and j["devices_held"] == 2
    assert len(j["timeline"]["progress"]) <= 50
    for node in ("fwd", "bwd"):  # thinned as a whole: each node's line still starts at the first sample
        points = [p for p in j["timeline"]["progress"] if p["node"] == node]
        assert points[0]["t"] == 1000.0 and len(points) >= 10
    assert max(p["step"] for p in j["timeline"]["progress"]) == 60  # the newest point is kept
    clock[0] += 1
    emit("job.recovering", step=60, recovery=1, lost={"w0": "event stream ended"})
    (j,) = rec.jobs()
    assert j["recoveries"][0]["mttr_s"] is None and j["timeline"]["faults"][0]["target"] == "w0"
    clock[0] += 1
    x.recoveries = [SimpleNamespace(to_json=lambda: {"recovery": 1, "detected_at": 1013.0, "mttr_s": 0.8,
                                                     "phases": {"detection": 0.1}})]
    emit("job.recovered", step=60, recovery=1, mttr_s=0.8, phases={"detection": 0.1}, placement={})
    (j,) = rec.jobs()
    assert j["recoveries"] == [{"recovery": 1, "detected_at": 1013.0, "mttr_s": 0.8, "phases": {"detection": 0.1},
                                "lost": {"w0": "event stream ended"}, "at_step": 60}]
    assert "recovery 1" in timeline_svg(j["timeline"])
    x.completed = 100
    emit("job.finished", step=100)
    (j,) = rec.jobs()
    assert j["state"] == "succeeded" and j["ended_at"] == clock[0] and j["step_done"] == 100
    # A second job that ends pushes the first out (keep_ended=1); a job that runs again starts afresh.
    rec.observe(x.view(), pb.JobEvent(job="k", event="job.failed", detail=json.dumps({"reason": "no room"})))
    assert [(j["job"], j["state"], j["reason"]) for j in rec.jobs()] == [("k", "failed", "no room")]
    rec.observe(FakeExecutor().view(), pb.JobEvent(job="k", event="job.placed"))
    assert rec.jobs()[0]["ended_at"] is None and rec.jobs()[0]["recoveries"] == []


def test_the_recorder_keeps_each_metric_by_step_with_recoveries_marked_and_jobs_json_draws_it() -> None:
    rec = TimelineRecorder(max_points=40)
    x = FakeExecutor()

    def emit(event: str, step: int = 0, metrics: dict[str, float] | None = None, **detail: Any) -> None:
        rec.observe(x.view(), pb.JobEvent(job="j", event=event, step=step, metrics=metrics or {}, detail=json.dumps(detail)))

    for s in range(30):
        emit("step.done", step=s, metrics={"loss": 1.0 / (s + 1)})
    emit("job.recovering", step=30, recovery=1, lost={"w0": "event stream ended"})
    x.recoveries = [SimpleNamespace(to_json=lambda: {"recovery": 1, "checkpoint_step": 20, "mttr_s": None,
                                                     "phases": {"detection": 0.1, "restore": 0.2}})]
    emit("job.recovered", step=20, recovery=1)
    for s in range(25, 60):  # steps 25..29 complete again after the recovery: their values are replaced
        emit("step.done", step=s, metrics={"loss": float("nan") if s == 59 else 2.0 / (s + 1)})
    emit("job.nonfinite", step=59, metric="loss", value="nan", action="warn")
    (j,) = rec.jobs()
    points = j["metrics"]["loss"]
    assert len(points) <= 40 and points[0] == [0, 1.0] and points[-1] == [59, None]  # bounded, ends kept
    assert [s for s, _ in points] == sorted({s for s, _ in points})  # one point per step, in order
    assert dict(map(tuple, points)).get(26, 2.0 / 27) == pytest.approx(2.0 / 27)  # the replayed value
    assert {"kind": "recovery", "step": 30, "from_step": 20, "label": "recovery 1"} in j["marks"]
    assert {"kind": "fault", "step": 30, "label": "lost w0"} in j["marks"]
    assert {"kind": "nonfinite", "step": 59, "label": "loss nan"} in j["marks"]
    (out,) = jobs_json([j], {})
    svg = out["metrics_svg"]
    assert svg.startswith("<svg") and 'data-metric="loss"' in svg and "recovery 1" in svg and "lost w0" in svg
    assert 'data-kind="recovery"' in svg and 'data-kind="nonfinite"' in svg and "<polyline" in svg
    assert metrics_svg({}, []) == "" and jobs_json([], {"k": {"state": "running"}})[0]["metrics_svg"] == ""
    evil = metrics_svg({EVIL: [[0, 1.0], [1, 2.0]]}, [{"kind": EVIL, "step": 1, "label": EVIL}])
    assert "<script" not in evil and "<img" not in evil and "&lt;script&gt;" in evil


def test_the_recorder_never_breaks_a_job() -> None:
    rec = TimelineRecorder()
    rec.observe(None, pb.JobEvent(job="j", event="step.done", step=1, detail="not json"))
    broken = FakeExecutor()
    broken.placement = {"s0": None}  # type: ignore[dict-item]
    rec.observe(broken.view(), pb.JobEvent(job="j", event="job.placed"))  # logged, not raised


def get(server: DashboardServer, path: str, host: str | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host or f"127.0.0.1:{server.port}")
        conn.endheaders()
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def test_the_server_routes_guards_its_host_and_survives_a_broken_route() -> None:
    server = DashboardServer("127.0.0.1", 0)
    server.mount("/", lambda _q: (200, "text/html; charset=utf-8", PAGE.encode()))
    server.mount("/api/echo", lambda q: json_response({"q": q}))
    server.mount("/broken", lambda _q: 1 / 0)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="absolute path"):
        server.mount("api", lambda _q: json_response({}))
    server.start()
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/"
        status, headers, body = get(server, "/")
        assert status == 200 and body.decode() == PAGE and "default-src 'none'" in headers["Content-Security-Policy"]
        assert headers["X-Content-Type-Options"] == "nosniff"
        status, _, body = get(server, "/api/echo?job=a&job=b", host=f"localhost:{server.port}")
        assert status == 200 and json.loads(body) == {"q": {"job": ["a", "b"]}}
        assert get(server, "/nowhere")[0] == 404
        assert get(server, "/broken")[0] == 500
        assert get(server, "/", host=f"evil.example:{server.port}")[0] == 421  # DNS rebinding
        assert get(server, "/")[0] == 200  # still serving
    finally:
        server.stop()


def test_a_port_in_use_is_a_clear_error() -> None:
    server = DashboardServer("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match=f"cannot serve the dashboard on 127.0.0.1:{server.port}"):
            DashboardServer("127.0.0.1", server.port)
    finally:
        server.stop()


def test_a_suspended_or_cancelled_job_ends_its_timeline_in_that_state_and_a_resume_starts_it_afresh() -> None:
    rec = TimelineRecorder(keep_ended=2)
    x = FakeExecutor()
    for job, end in (("a", "job.suspended"), ("b", "job.cancelled")):
        rec.observe(x.view(), pb.JobEvent(job=job, event="job.placed"))
        rec.observe(x.view(), pb.JobEvent(job=job, event=end, step=7, detail=json.dumps({"reason": "by operator ann"})))
    states = {j["job"]: (j["state"], j["reason"], j["ended_at"] is not None) for j in rec.jobs()}
    assert states == {"a": ("suspended", "by operator ann", True), "b": ("cancelled", "by operator ann", True)}
    rec.observe(FakeExecutor().view(), pb.JobEvent(job="a", event="job.placed"))  # resumed
    assert {j["job"]: j["state"] for j in rec.jobs()}["a"] == "running"
