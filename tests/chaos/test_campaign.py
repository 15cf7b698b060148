"""Chaos campaigns: the table and its totals (pure), the loop with a stand-in runner, the
bad inputs through the real CLI, and one real campaign of ``campaign-short``: one seed that draws
each of its six fault kinds once (``make soak`` runs 20 seeds of ``campaign``)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rallypoint.chaos.campaign import (CAMPAIGN_FILE, campaign_data, check_campaign, default_out_dir,
                                       format_campaign, percentile, run_campaign, seed_list, seed_row, totals)
from rallypoint.chaos.scenario import KINDS, Scenario, load_scenario
from rallypoint.chaos.report import SUMMARY_FILE
from rallypoint.basics.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SLICES = ["stage0", "stage1", "stage2", "stage3"]
WORKER_KINDS = {"kill", "hang", "straggler", "partition"}
LEADER_KINDS = {"leader_kill", "leader_hang"}
T0 = 1796220000.0


def make_summary(seed: int, *, ok: bool = True, mttrs: tuple[float | None, ...] = (0.8,), goodput: float = 0.95,
                 fired: dict[str, int] | None = None, wall_s: float = 41.5) -> dict[str, Any]:
    """A summary shaped like run_scenario's (see tests/chaos/test_report.py)."""
    fired = {"kill": 1, "hang": 1} if fired is None else fired
    return {
        "scenario": "campaign-short", "description": "d", "seed": seed, "started_at": T0, "ended_at": T0 + wall_s,
        "job": {"name": "pipeline-mlp", "steps": 400, "policy": "partial", "checkpoint_every": 10},
        "cluster": {"workers": 4, "spares": 3, "devices_per_worker": 1, "etcd_members": 1,
                    "network": "proxy", "storage": "local disk"},
        "outcome": {"state": "finished" if ok else "failed", "reason": "" if ok else "timed out after 300s",
                    "wall_s": wall_s, "expected": "finished", "time_bound_s": 180},
        "faults": [{"kind": k, "target": "stage1", "origin": "random", "worker": "w1", "at": T0 + 2.0 + i,
                    "step": 10 * i, "healed_at": None, "detail": {}}
                   for i, k in enumerate(k for k, n in fired.items() for _ in range(n))],
        "fired": fired, "healed": {k: n for k, n in fired.items() if KINDS[k][1]},
        "resumes": [],
        "recoveries": [{"recovery": i + 1, "lost": {"w1": ["stage1"]}, "policy": "partial", "checkpoint_step": 10,
                        "detected_at": T0 + 3.0 + i, "phases": {"detection": 0.01}, "mttr_s": m}
                       for i, m in enumerate(mttrs)],
        "invariants": [
            {"name": "final-state-digest", "ok": ok, "evidence": "digest"},
            {"name": "applied-exactly-once", "ok": ok, "evidence": "records"},
            {"name": "exclusive-device-leases", "ok": True, "evidence": "leases"},
            {"name": "committed-checkpoints-restore", "ok": True, "evidence": "commits"},
            {"name": "outcome", "ok": ok, "evidence": "outcome"},
        ],
        "ok": ok,
        "goodput": {"useful_device_s": 10.0, "redone_device_s": 0.5, "goodput": goodput,
                    "steps_per_s": 9.6, "fault_free_wall_s": 8.0},
        "mttr_s": {"median": None, "max": None},
        "progress": [],
        **({} if ok else {"logs": f"/tmp/rallypoint-chaos-campaign-short-{seed}/logs"}),
    }


# -- the pure part ---------------------------------------------------------------------------------


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 90) is None
    assert percentile([3.0], 90) == 3.0
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 90) == 9.0
    assert percentile(values, 50) == 5.0
    assert percentile(values, 100) == 10.0
    assert percentile(list(reversed(values)), 91) == 10.0


def test_seed_row_from_a_passing_summary() -> None:
    row = seed_row(7, make_summary(7, mttrs=(0.5, 1.5, None, 0.9), fired={"kill": 2, "partition": 1}),
                   Path("/r/seed-7"))
    assert row["seed"] == 7 and row["ok"] and row["state"] == "finished" and row["wall_s"] == 41.5
    assert row["fired"] == {"kill": 2, "partition": 1}
    assert row["recoveries"] == 4  # the one without an MTTR still counts as a recovery
    assert row["mttrs_s"] == [0.5, 1.5, 0.9]
    assert row["mttr_median_s"] == 0.9 and row["mttr_max_s"] == 1.5
    assert row["goodput"] == 0.95 and row["failed_invariants"] == [] and row["report"] == "/r/seed-7"
    assert row["logs"] is None


def test_seed_row_from_a_failing_summary_names_the_invariants() -> None:
    row = seed_row(8, make_summary(8, ok=False, mttrs=()))
    assert not row["ok"] and row["state"] == "failed" and "timed out" in row["reason"]
    assert row["failed_invariants"] == ["final-state-digest", "applied-exactly-once", "outcome"]
    assert row["mttr_median_s"] is None and row["mttr_max_s"] is None and row["recoveries"] == 0
    assert row["logs"].endswith("-8/logs")


def test_fault_errors_and_unfired_faults_are_counted_apart_from_fired() -> None:
    s = make_summary(1, fired={"kill": 1})
    s["faults"].append({"kind": "leader_kill", "target": "", "error": "no leader", "at": T0, "step": 3})
    row = seed_row(1, s, scheduled=5)
    assert row["fired"] == {"kill": 1} and row["fault_errors"] == 1
    assert row["scheduled"] == 5 and row["unfired"] == 3  # two tried (one fired, one failed to), three never
    assert seed_row(1, s)["unfired"] is None  # not known
    t = totals([row, seed_row(2, make_summary(2), scheduled=2)])
    assert t["unfired"] == 3 and t["fault_errors"] == 1
    text = format_campaign(campaign_data("x", "x.toml", [1], [row], started_at=T0, ended_at=T0, out_dir=Path("/c")))
    assert re.search(r"^1\s+ok\s+finished\s+41\.5\s+kill:1 errors:1 unfired:3\s", text, re.M)
    assert "faults kill:1 errors:1 unfired:3" in text


def test_totals_pool_every_recovery_and_take_the_median_goodput() -> None:
    rows = [seed_row(1, make_summary(1, mttrs=(1.0, 2.0), goodput=0.9, fired={"kill": 1, "hang": 1})),
            seed_row(2, make_summary(2, ok=False, mttrs=(3.0,), goodput=0.5, fired={"kill": 2})),
            seed_row(3, make_summary(3, mttrs=(4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0), goodput=0.8,
                                     fired={"leader_kill": 1}))]
    t = totals(rows)
    assert (t["seeds"], t["passed"], t["failed"]) == (3, 2, 1)
    assert t["pass_rate"] == round(2 / 3, 4)
    assert t["recoveries"] == 10
    assert t["mttr_s"] == {"median": 5.5, "p90": 9.0, "max": 10.0}
    assert t["goodput_median"] == 0.8
    assert t["faults_fired"] == {"hang": 1, "kill": 3, "leader_kill": 1}
    assert t["failed_invariants"] == {"applied-exactly-once": 1, "final-state-digest": 1, "outcome": 1}


def test_totals_without_recoveries_or_rows() -> None:
    t = totals([seed_row(1, make_summary(1, mttrs=(), fired={"straggler": 1}))])
    assert t["mttr_s"] == {"median": None, "p90": None, "max": None} and t["pass_rate"] == 1.0
    empty = totals([])
    assert empty["seeds"] == 0 and empty["pass_rate"] is None and empty["goodput_median"] is None


def test_campaign_data_lists_the_failed_seeds_with_their_reports() -> None:
    rows = [seed_row(4, make_summary(4), None), seed_row(5, make_summary(5, ok=False), Path("/c/seed-5"))]
    data = campaign_data("campaign-short", "scenarios/campaign-short.toml", [4, 5], rows,
                         started_at=T0, ended_at=T0 + 90.0, out_dir=Path("/c"))
    assert not data["ok"] and data["complete"] and data["wall_s"] == 90.0
    assert data["failed"] == [{"seed": 5, "state": "failed", "reason": "timed out after 300s",
                               "failed_invariants": ["final-state-digest", "applied-exactly-once", "outcome"],
                               "report": "/c/seed-5", "logs": "/tmp/rallypoint-chaos-campaign-short-5/logs"}]
    assert json.loads(json.dumps(data)) == data  # campaign.json holds exactly this
    passing = campaign_data("x", "x.toml", [4], rows[:1], started_at=T0, ended_at=T0, out_dir=Path("/c"))
    assert passing["ok"] and passing["failed"] == []
    short = campaign_data("x", "x.toml", [4, 5], rows[:1], started_at=T0, ended_at=T0, out_dir=Path("/c"))
    assert not short["ok"]  # a seed not run is not a pass


def test_format_campaign_lists_every_seed_and_the_totals() -> None:
    rows = [seed_row(10, make_summary(10, mttrs=(0.5, 1.5), fired={"kill": 1, "leader_hang": 2})),
            seed_row(11, make_summary(11, ok=False, mttrs=(2.5,), goodput=0.4), Path("/c/seed-11")),
            seed_row(12, make_summary(12, mttrs=(), fired={}))]
    text = format_campaign(campaign_data("campaign-short", "f.toml", [10, 11, 12], rows, started_at=T0,
                                         ended_at=T0 + 123.4, out_dir=Path("/c")))
    lines = text.splitlines()
    assert "campaign-short" in lines[0] and "3 seeds" in lines[0] and "10..12" in lines[0] and "123.4s" in lines[0]
    assert re.search(r"^seed\s+result\s+state\s+wall_s\s+faults fired", lines[1])
    assert re.search(r"^10\s+ok\s+finished\s+41\.5\s+kill:1 leader_hang:2\s+2\s+1\.000\s+1\.500\s+0\.950\s+-$",
                     text, re.M)
    assert re.search(r"^11\s+FAILED\s+failed\s+.*final-state-digest,applied-exactly-once,outcome$", text, re.M)
    assert re.search(r"^12\s+ok\s+finished\s+41\.5\s+-\s+0\s+-\s+-\s+0\.950", text, re.M)
    assert "2 passed, 1 failed (pass rate 67%)" in text
    assert "MTTR median 1.500s  p90 2.500s  max 2.500s  goodput median 0.950" in text
    assert "failed seed 11: failed timed out after 300s; report /c/seed-11" in text
    assert "\x1b" not in text


# -- input checks and the loop (a stand-in runner, no processes) ----------------------------------------


def short_scenario() -> Scenario:
    return load_scenario(ROOT / "scenarios" / "campaign-short.toml")


def test_check_campaign_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    s = short_scenario()
    check_campaign(s, 1, tmp_path / "new")  # fine
    check_campaign(s, 3, tmp_path)  # an empty folder is fine too
    with pytest.raises(ConfigError, match=r"--seeds must be at least 1, got 0"):
        check_campaign(s, 0)
    with pytest.raises(ConfigError, match=r"no \[random\] section"):
        check_campaign(load_scenario(ROOT / "scenarios" / "kill-worker.toml"), 3)
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(ConfigError, match="not an empty folder"):
        check_campaign(s, 3, tmp_path)


def test_seed_list_and_default_folder() -> None:
    assert seed_list(31, 3) == [31, 32, 33]
    assert seed_list(0, 1) == [0]
    d = default_out_dir("campaign", T0)
    assert d.parent == Path("chaos-reports") and re.fullmatch(r"campaign-campaign-\d{8}T\d{6}", d.name)


@pytest.mark.parametrize("name", ["campaign", "campaign-short"])
def test_campaign_scenarios_draw_worker_and_leader_faults_that_depend_on_the_seed(name: str) -> None:
    s = load_scenario(ROOT / "scenarios" / f"{name}.toml")
    assert s.random is not None and s.random.mtbf_s == 5.0
    assert WORKER_KINDS | LEADER_KINDS <= set(s.random.kinds)
    assert s.coordinators >= 2 and s.spares >= 3 and s.job_file.name == "pipeline_mlp.py"
    assert s.expect_outcome == "finished" and s.time_bound_s > 0
    schedules = [tuple(s.with_seed(seed).schedule(SLICES)) for seed in seed_list(s.random.seed, 5)]
    assert len(set(schedules)) == 5  # another seed, another schedule
    assert s.with_seed(s.random.seed + 1).schedule(SLICES) == s.with_seed(s.random.seed + 1).schedule(SLICES)
    assert all(f.origin == "random" for sch in schedules for f in sch)


def test_the_short_campaigns_seed_draws_every_kind_it_may() -> None:
    s = short_scenario()
    assert s.random is not None
    drawn = Counter(f.kind for f in s.with_seed(s.random.seed).schedule(SLICES))
    assert set(drawn) == WORKER_KINDS | LEADER_KINDS == set(s.random.kinds)
    assert 6 <= sum(drawn.values()) <= 20


def test_run_campaign_keeps_only_the_failed_seeds_reports(tmp_path: Path) -> None:
    from rallypoint.chaos.report import write_report

    seen: list[Scenario] = []

    def runner(scenario: Scenario, *, out_dir: Path, say: Any) -> tuple[dict[str, Any], Path]:
        seen.append(scenario)
        say({"event": "chaos.fault", "kind": "kill"})
        if scenario.seed == 6:
            raise RuntimeError("cluster did not start")
        summary = make_summary(scenario.seed or 0, ok=scenario.seed != 5)
        return summary, write_report(out_dir, summary)

    events: list[dict[str, Any]] = []
    s = short_scenario()
    data = run_campaign(s, [4, 5, 6], tmp_path / "c", say=events.append, runner=runner)
    assert [x.seed for x in seen] == [4, 5, 6]
    assert data["rows"][0]["scheduled"] == len(s.with_seed(4).schedule(SLICES)) > 0
    assert data["rows"][0]["unfired"] == max(0, data["rows"][0]["scheduled"] - 2)
    assert all(dataclasses.replace(x, random=s.random) == s for x in seen)  # only the seed differs
    assert {"event": "chaos.fault", "kind": "kill", "seed": 5} in events
    assert [e["seed"] for e in events if e["event"] == "chaos.campaign.seed"] == [4, 5, 6]
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [CAMPAIGN_FILE, "seed-5"]
    assert (tmp_path / "c" / "seed-5" / "summary.json").is_file()
    on_disk = json.loads((tmp_path / "c" / CAMPAIGN_FILE).read_text())
    assert on_disk == data
    assert not data["ok"] and data["totals"]["passed"] == 1 and data["totals"]["failed"] == 2
    assert [f["seed"] for f in data["failed"]] == [5, 6]
    assert data["failed"][0]["report"] == str(tmp_path / "c" / "seed-5")
    assert data["rows"][0]["report"] is None
    assert data["rows"][2]["state"] == "error" and data["rows"][2]["failed_invariants"] == ["harness-error"]
    assert "cluster did not start" in data["rows"][2]["reason"]

    kept = run_campaign(s, [4], tmp_path / "k", keep_all=True, runner=runner)
    assert kept["ok"] and (tmp_path / "k" / "seed-4" / "summary.json").is_file()
    assert kept["rows"][0]["report"] == str(tmp_path / "k" / "seed-4")


# -- the real CLI -------------------------------------------------------------------------------------------


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rallypoint.cli", "chaos", "campaign", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["scenarios/nope.toml", "--seeds", "3"], "scenario file scenarios/nope.toml does not exist"),
    (["scenarios/campaign-short.toml", "--seeds", "0"], "--seeds must be at least 1, got 0"),
    (["scenarios/kill-worker.toml", "--seeds", "3"], "has no [random] section"),
])
@pytest.mark.processes
def test_bad_input_is_one_clear_line_and_writes_nothing(args: list[str], message: str, tmp_path: Path) -> None:
    out = tmp_path / "campaign"
    r = cli(*args, "--out", str(out))
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not out.exists()


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_real_campaign_of_random_faults_passes_every_invariant(tmp_path: Path) -> None:
    out = tmp_path / "campaign"
    r = cli("scenarios/campaign-short.toml", "--seeds", "1", "--out", str(out), timeout=580)
    # What failed, first (its invariants' evidence and why), then the exit status: a failure must say what broke.
    assert (out / CAMPAIGN_FILE).exists(), (r.returncode, r.stdout[-4000:], r.stderr[-4000:])
    data = json.loads((out / CAMPAIGN_FILE).read_text())
    failed = [(row["seed"], row["failed_invariants"], row["reason"], row["logs"]) for row in data["rows"] if not row["ok"]]
    assert not failed, (failed, _evidence(out))
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
    seeds = seed_list(short_scenario().seed or 0, 1)
    assert data["seeds"] == seeds and data["complete"] and data["ok"]
    assert [row["seed"] for row in data["rows"]] == seeds
    assert data["totals"]["passed"] == 1 and data["totals"]["failed"] == 0 and data["failed"] == []
    assert set(data["totals"]["faults_fired"]) == WORKER_KINDS | LEADER_KINDS and data["totals"]["recoveries"] > 0
    # Every scheduled fault was tried (fired, or failed to and said why): none was left for after the end.
    assert all(row["scheduled"] and row["unfired"] == 0 for row in data["rows"])
    table = [line for line in r.stdout.splitlines() if re.match(r"^\d+\s+(ok|FAILED)\s", line)]
    assert [int(line.split()[0]) for line in table] == seeds
    assert all(line.split()[1:3] == ["ok", "finished"] for line in table)
    for row, line in zip(data["rows"], table):
        assert f"{row['wall_s']:.1f}" in line.split()
    assert "1 passed, 0 failed (pass rate 100%)" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == [CAMPAIGN_FILE]  # passed seeds' reports removed


def _evidence(out: Path) -> list[tuple[str, str]]:
    """The failed invariants' evidence in the failed seeds' reports under ``out``."""
    found = []
    for report in sorted(out.rglob(SUMMARY_FILE)):
        summary = json.loads(report.read_text())
        found += [(c["name"], str(c["evidence"])[:1500]) for c in summary.get("invariants", []) if not c["ok"]]
        found += [("outcome", str(summary.get("outcome")))]
    return found
