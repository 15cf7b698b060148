"""Tests of chaos run reports: the folder, the plain-text table and the timeline page."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

from rallypoint.chaos.report import ReportError, format_table, load_report, write_report
from rallypoint.basics.errors import RallypointError

T0 = 1796220000.0


def make_summary() -> dict[str, Any]:
    return {
        "scenario": "kill-one-worker", "description": "SIGKILL the worker of stage2 <mid-run>",
        "seed": 7, "started_at": T0, "ended_at": T0 + 30.0,
        "job": {"name": "pipeline-mlp", "steps": 40, "policy": "partial", "checkpoint_every": 5},
        "cluster": {"workers": 4, "spares": 1, "devices_per_worker": 1, "etcd_members": 1,
                    "network": "netns"},
        "outcome": {"state": "finished", "reason": "", "wall_s": 12.3, "expected": "finished",
                    "time_bound_s": 120},
        "faults": [
            {"kind": "kill", "target": "stage2", "worker": "w2", "at": T0 + 5.0, "step": 12,
             "healed_at": None, "detail": {"pid": 123}},
            {"kind": "partition", "target": "etcd", "worker": "w1", "at": T0 + 15.0, "step": 25,
             "healed_at": T0 + 17.5, "detail": {}},
        ],
        "recoveries": [
            {"recovery": 1, "lost": {"w2": ["stage2"]}, "policy": "partial", "checkpoint_step": 10,
             "detected_at": T0 + 5.1,
             "phases": {"detection": 0.01, "fencing": 0.2, "remap": 0.004, "restore": 0.05,
                        "replay": 0.6, "catch_up": 0.0},
             "mttr_s": 0.864},
            {"recovery": 2, "lost": {"w1": ["stage0", "stage1"]}, "policy": "partial",
             "checkpoint_step": 25, "detected_at": T0 + 15.2,
             "phases": {"detection": 0.02}, "mttr_s": None},
        ],
        "invariants": [
            {"name": "final-state-digest", "ok": True, "evidence": "digest 3f9a == reference 3f9a"},
            {"name": "exclusive-device-lease", "ok": False,
             "evidence": "device leased while held: " + "x" * 300},
        ],
        "goodput": {"useful_device_s": 10.0, "redone_device_s": 0.5, "goodput": 0.95,
                    "steps_per_s": 3.2, "fault_free_wall_s": 8.0},
        "mttr_s": {"median": 0.864, "max": 0.864},
        "progress": [
            {"t": T0 + 1.0 * i, "node": node, "step": i + off}
            for i in range(1, 20) for node, off in (("fwd0", 1), ("fwd1", 0), ("loss", 0))
        ],
    }


def test_write_report_creates_both_files_and_round_trips(tmp_path: Path) -> None:
    summary = make_summary()
    folder = tmp_path / "runs" / "kill-one-worker"
    assert write_report(folder, summary) == folder
    assert (folder / "summary.json").is_file()
    assert (folder / "timeline.html").is_file()
    assert load_report(folder) == summary
    assert sorted(p.name for p in folder.iterdir()) == ["summary.json", "timeline.html"]


def test_timeline_is_self_contained_svg(tmp_path: Path) -> None:
    page = (write_report(tmp_path, make_summary()) / "timeline.html").read_text()
    assert "<svg" in page
    assert page.count("<polyline") == 3
    for node in ("fwd0", "fwd1", "loss"):
        assert f">{node}</text>" in page  # the legend
    assert "kill stage2" in page
    assert "partition etcd" in page
    assert "recovery 1" in page and "recovery 2" in page
    assert "<title>kill-one-worker</title>" in page
    assert "<script src" not in page
    assert "http://" not in page and "https://" not in page
    assert "url(" not in page and "<img" not in page
    # Text is escaped, invariants and their results are listed.
    assert "&lt;mid-run&gt;" in page and "<mid-run>" not in page
    assert "final-state-digest" in page and "exclusive-device-lease" in page
    assert ">OK</td>" in page and ">FAILED</td>" in page
    # A healed fault gets a shaded band, a recovery with an MTTR a green band.
    assert 'fill="#d62728" fill-opacity="0.1"' in page
    assert page.count('fill="#2a9d2a"') == 1


def test_polylines_follow_progress(tmp_path: Path) -> None:
    page = (write_report(tmp_path, make_summary()) / "timeline.html").read_text()
    lines = re.findall(r'<polyline points="([^"]+)"', page)
    for points in lines:
        ys = [float(p.split(",")[1]) for p in points.split()]
        xs = [float(p.split(",")[0]) for p in points.split()]
        assert xs == sorted(xs)
        assert ys == sorted(ys, reverse=True)  # steps rise, SVG y falls
    assert len(set(re.findall(r'<polyline [^>]*stroke="(#[0-9a-f]{6})"', page))) == 3


def test_format_table(tmp_path: Path) -> None:
    text = format_table(make_summary())
    first = text.splitlines()[0]
    assert "kill-one-worker" in first and "seed=7" in first and "netns" in first
    assert "finished" in first and "12.3s" in first and "120s" in first
    assert "\x1b" not in text
    assert re.search(r"final-state-digest\s+OK\s", text)
    assert re.search(r"exclusive-device-lease\s+FAILED\s", text)
    assert "x" * 120 not in text  # evidence is truncated
    assert re.search(r"kill\s+stage2\s+w2\s+12\s+5\.00\s+-", text)
    assert re.search(r"partition\s+etcd\s+w1\s+25\s+15\.00\s+2\.50", text)
    assert "w2->stage2" in text and "w1->stage0,stage1" in text
    assert "0.864" in text
    assert "goodput 0.950" in text
    assert "MTTR median 0.864s" in text


def test_format_table_empty_and_missing_values() -> None:
    summary = make_summary()
    summary.update(faults=[], recoveries=[], invariants=[], progress=[],
                   mttr_s={"median": None, "max": None})
    text = format_table(summary)
    assert text.count("(none)") == 3
    assert "MTTR median -s" in text


def test_write_report_with_empty_lists(tmp_path: Path) -> None:
    summary = make_summary()
    summary.update(faults=[], recoveries=[], invariants=[], progress=[])
    page = (write_report(tmp_path, summary) / "timeline.html").read_text()
    assert "<svg" in page and "<polyline" not in page


def test_write_report_does_not_change_summary(tmp_path: Path) -> None:
    summary = make_summary()
    before = copy.deepcopy(summary)
    write_report(tmp_path, summary)
    assert summary == before


def test_load_report_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ReportError, match=re.escape(str(missing))):
        load_report(missing)


def test_load_report_missing_summary(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=re.escape(str(tmp_path / "summary.json"))):
        load_report(tmp_path)


def test_load_report_invalid_json(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(ReportError, match=re.escape(str(tmp_path / "summary.json"))) as info:
        load_report(tmp_path)
    assert isinstance(info.value, RallypointError)
    assert "not valid JSON" in str(info.value)


def test_load_report_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text("[1, 2]")
    with pytest.raises(ReportError, match="not an object"):
        load_report(tmp_path)
