"""The leader's dashboard in a real headless browser, on a real local cluster, through a real SIGKILL.

Chromium (the system package) loads the page, runs its script (which polls
``/api/cluster``) and prints the DOM (``--dump-dom``); the tests read the elements' ``data-*``
attributes. Where no Chromium binary is found (``make browser`` installs it), the browser
tests skip, and the reason is printed in the session summary. The first test saves a
screenshot under its tmp dir and prints its path there too. (That `rallypoint up` prints the
dashboard's address and that it answers: tests/client/test_cli.py.)
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from rallypoint.client.compile import compile_program
from rallypoint.client.commands.faults import Fault
from rallypoint.cluster.local import LocalCluster
from tests.conftest import SESSION_NOTES, wait_until
from tests.examples import example
from tests.helpers.cluster import assert_settled, run

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
CHROMIUM = next((b for name in BROWSERS if (b := shutil.which(name))), None)
if CHROMIUM is None:
    SESSION_NOTES.append(f"dashboard browser tests SKIPPED: no {' / '.join(BROWSERS)} binary on PATH "
                         "(`make browser` installs Chromium with apt-get)")
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason=f"no {' / '.join(BROWSERS)} binary on PATH: "
                                   "`make browser` installs Chromium (apt-get install -y chromium)")
# Long enough that two dumps (a Chromium start each, seconds on a loaded 2-core host) see the job step between
# them well before its end, and that its loss curve has over 100 points.
STEPS = 200
KILL_AT = 120


def chromium(url: str, *extra: str, budget_ms: int = 2000) -> str:
    assert CHROMIUM is not None
    r = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--no-first-run", f"--virtual-time-budget={budget_ms}", *extra, url],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, f"chromium failed ({r.returncode}): {r.stderr[-2000:]}"
    return r.stdout


class Dom(HTMLParser):
    """Every element's attributes by id, and the rows with ``data-worker`` / ``data-job``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.by_id: dict[str, dict[str, str]] = {}
        self.workers: dict[str, dict[str, str]] = {}
        self.jobs: dict[str, dict[str, str]] = {}
        self.recoveries: list[dict[str, str]] = []
        self.metrics: dict[str, dict[str, str]] = {}  # job -> its div.metrics (the metric curves)
        self.text = text
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.by_id[a["id"]] = a
        if tag == "tr" and "data-worker" in a:
            self.workers[a["data-worker"]] = a
        if tag == "tr" and "data-job" in a:
            self.jobs[a["data-job"]] = a
        if "data-recovery" in a:
            self.recoveries.append(a)
        if tag == "div" and "metrics" in a.get("class", "").split() and "data-job" in a:
            self.metrics[a["data-job"]] = a


def dump(url: str) -> Dom:
    dom = Dom(chromium(url, "--dump-dom"))
    assert int(dom.text.split('data-polls="', 1)[1].split('"', 1)[0]) >= 1, "the page never rendered /api/cluster"
    return dom


def api(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "api/cluster", timeout=5) as r:
        return json.loads(r.read())


def job_step(url: str, job: str) -> int:
    return next((j["step_done"] for j in api(url)["jobs"] if j["job"] == job), -1)


@needs_browser
def test_the_page_shows_the_workers_a_job_moving_and_a_recovery_after_a_kill(
    local_cluster: Callable[..., LocalCluster], tmp_path: Path,
) -> None:
    compiled = compile_program(example("pipeline_mlp").build(steps=STEPS, width=256, microbatch_size=64))
    job = compiled.program.name
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=2)
    url = lc.leader_dashboard()
    assert url and url.startswith("http://127.0.0.1:"), url

    # (1) The page loads and lists every worker with its state.
    dom = dump(url)
    assert set(dom.workers) == {f"w{i}" for i in range(5)}
    assert {w["data-state"] for w in dom.workers.values()} == {"spare"}
    assert dom.by_id["leader"]["data-leading"] == "true"

    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            outcome["result"], outcome["injector"] = run(lc, compiled, [Fault("stage2", "stage2", KILL_AT)])
        except BaseException as exc:  # reported by the test thread
            outcome["error"] = exc

    trainer = threading.Thread(target=train, name="train", daemon=True)
    trainer.start()
    try:
        # (2) Two dumps taken apart: the job's step moved forward between them.
        wait_until(lambda: job_step(url, job) >= 3 or "error" in outcome, 120, "the job to start stepping")
        first = dump(url).jobs[job]

        def moved() -> dict[str, str] | None:
            row = dump(url).jobs[job]
            return row if int(row["data-step"]) > int(first["data-step"]) else None

        second = wait_until(moved, 30, "the page to show the job's step moving")
        assert first["data-state"] in ("running", "recovering") and int(second["data-steps"]) == STEPS
        assert int(first["data-step"]) < int(second["data-step"]) < STEPS, (first, second)
    finally:
        trainer.join(300)
    assert not trainer.is_alive(), "the job did not end"
    if "error" in outcome:
        raise outcome["error"]
    result, injector = outcome["result"], outcome["injector"]
    assert result.state_digest and len(result.recovery["recoveries"]) == 1
    victim = injector.fired[0]["worker"]

    # (3) After the kill: the recovery (its entry, the job's count, the band in the timeline) and the lost worker.
    dom = dump(url)
    row = dom.jobs[job]
    assert row["data-state"] == "succeeded" and int(row["data-step"]) == STEPS and row["data-recoveries"] == "1"
    (rec,) = [r for r in dom.recoveries if r["data-job"] == job]
    assert rec["data-recovery"] == "1" and float(rec["data-mttr"]) > 0
    assert dom.workers[victim]["data-state"] == "lost"
    assert re.search(r'<text[^>]*fill="#1e6e1e"[^>]*>recovery 1</text>', dom.text), "no recovery band in the SVG"
    assert f">lost {victim}</text>" in dom.text, "no fault line for the lost worker in the SVG"
    # The loss curve by step, the recovery marked on it (a band from the cut restored to the step hit).
    curve = dom.metrics[job]
    assert curve["data-metrics"] == "loss" and 100 <= int(curve["data-points"]) <= STEPS, curve
    assert '<rect class="mark" data-kind="recovery"' in dom.text, "no recovery band on the metric curve"
    assert_settled(lc)

    # (4) A screenshot, its path printed in the session summary.
    shot = tmp_path / "dashboard.png"
    chromium(url, f"--screenshot={shot}", "--window-size=1200,1400")
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    SESSION_NOTES.append(f"dashboard screenshot: {shot}")
    print(f"dashboard screenshot: {shot}")


@needs_browser
def test_a_follower_points_to_the_leader(local_cluster: Callable[..., LocalCluster]) -> None:
    lc = local_cluster(workers=1, spares=0, devices_per_worker=1, coordinators=2)
    leader_url = lc.leader_dashboard()
    store = lc.store()

    def follower_dashboard() -> str | None:  # the follower publishes its key on its first campaign
        leader = store.get(lc.keys.leader).json()["coordinator"]
        others = [json.loads(kv.value) for kv in store.get_prefix(lc.keys.coordinators)[0]]
        return next((c.get("dashboard") for c in others if c["coordinator"] != leader), None)

    try:
        follower = wait_until(follower_dashboard, 30, "the follower to publish its dashboard")
    finally:
        store.close()
    dom = dump(follower)
    assert dom.by_id["leader"]["data-leading"] == "false"
    assert dom.by_id["leader-link"]["href"] == leader_url
    assert set(dom.workers) == {"w0"}


def test_a_bad_dashboard_port_is_a_clear_error() -> None:
    r = subprocess.run([sys.executable, "-m", "rallypoint.cluster.daemons", "coordinator", "--cluster", "127.0.0.1:1",
                        "--id", "c0", "--dashboard-port", "70000"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--dashboard-port" in r.stderr and "70000" in r.stderr
