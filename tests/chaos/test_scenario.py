"""Scenario files and the pure outcome check: no processes (applied-exactly-once: test_applied_once.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from rallypoint.chaos.invariants import check_outcome
from rallypoint.chaos.scenario import KINDS, load_scenario
from rallypoint.basics.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((ROOT / "scenarios").glob("*.toml"))


def test_the_shipped_scenarios_load_and_cover_every_fault_kind() -> None:
    assert len(SCENARIOS) >= 8
    kinds: set[str] = set()
    for path in SCENARIOS:
        s = load_scenario(path)
        assert s.name == path.stem and s.job_file.exists()
        kinds |= s.kinds
    assert kinds == set(KINDS), f"no scenario fires {sorted(set(KINDS) - kinds)}"


def test_the_same_seed_gives_the_same_random_schedule_and_another_seed_another() -> None:
    soak = load_scenario(ROOT / "scenarios" / "soak.toml")
    slices = ["stage0", "stage1", "stage2", "stage3"]
    first, again = soak.schedule(slices), soak.with_seed(soak.seed or 0).schedule(slices)
    assert first == again and len(first) >= 5
    assert soak.with_seed(12345).schedule(slices) != first
    assert all(f.origin == "random" and f.at_s is not None and 0 <= f.at_s < 150 for f in first)


def test_only_the_storms_and_the_short_campaign_ask_for_a_supervised_cluster() -> None:
    supervised = {p.stem for p in SCENARIOS if load_scenario(p).supervise}
    # Random leader kills can outnumber the coordinators (campaign-short seed 11: three); elsewhere a killed process
    # stays dead, as the scenarios expect.
    assert supervised == {"campaign-storm", "campaign-storm-eval", "campaign-short", "lm-storm"}
    storm = load_scenario(ROOT / "scenarios" / "campaign-storm.toml")
    assert (storm.workers, storm.spares) == (4, 2) and storm.random is not None


def write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "s.toml"
    p.write_text('[job]\nfile = "examples/pipeline_mlp.py"\n' + body)
    return p


@pytest.mark.parametrize("body,message", [
    ('[[faults]]\nkind = "explode"\nat_step = 3\n', r"#1\.kind: 'explode' is not one of"),
    ('[[faults]]\nkind = "kill"\nat_step = 3\n', r"#1\.target: a kill fault needs a target"),
    ('[[faults]]\nkind = "kill"\ntarget = "stage0"\n', r"#1: give exactly one of at_step and at_s"),
    ('[[faults]]\nkind = "etcd_kill"\nat_step = 3\n', r"need \[cluster\]\.etcd_members = 3"),
    ('[cluster]\nworkers = "four"\n', r"\[cluster\]\.workers: expected int, got 'four'"),
    ('[cluster]\ncompile_cache = "yes"\n', r"\[cluster\]\.compile_cache: expected bool, got 'yes'"),
    ('[cluster]\nsupervise = 1\n', r"\[cluster\]\.supervise: expected bool, got 1"),
    ('[expect]\noutcome = "maybe"\n', r"\[expect\]\.outcome: 'maybe'"),
    ('[jobb]\n', r"unknown keys \['jobb'\]"),
    ('[random]\nkinds = []\n', r"\[random\]\.kinds"),
    ('[[faults]]\nkind = "kill"\ntarget = "w0"\nat_step = 3\nuntil_step = 9\n', r"#1\.until_step: a kill fault has no"),
    ('[[faults]]\nkind = "hang"\ntarget = "w0"\nat_step = 3\nuntil_step = 9\nduration_s = 2\n',
     r"#1: give at most one of duration_s and until_step"),
    ('[[faults]]\nkind = "hang"\ntarget = "w0"\nat_s = 3\nuntil_step = 9\n', r"#1\.until_step: needs at_step"),
    ('[[faults]]\nkind = "hang"\ntarget = "w0"\nat_step = 9\nuntil_step = 9\n', r"must be past it"),
    ('[[faults]]\nkind = "suspend"\nat_step = 5\nresume_after_s = -1\n', r"#1\.resume_after_s: .*0 to 600; got -1"),
    ('[[faults]]\nkind = "suspend"\nat_step = 5\nresume_after_s = "soon"\n',
     r"#1\.resume_after_s: expected int or float, got 'soon'"),
    ('[[faults]]\nkind = "suspend"\nat_step = 5\nresume_after_s = true\n', r"#1\.resume_after_s: expected int or float"),
    ('[[faults]]\nkind = "kill"\ntarget = "stage0"\nat_step = 5\nresume_after_s = 1\n',
     r"#1\.resume_after_s: only a suspend is resumed; a kill fault takes no resume_after_s"),
    ('[[faults]]\nkind = "suspend"\ntarget = "stage0"\nat_step = 5\n', r"#1\.target: a suspend acts on the whole job"),
    ('[[faults]]\nkind = "suspend"\n', r"#1: give exactly one of at_step and at_s"),
    ('[expect]\noutcome = "failed"\n[[faults]]\nkind = "suspend"\nat_step = 5\n', r"its job must end finished"),
    ('[random]\nkinds = ["kill", "suspend"]\n', r"\[random\]\.kinds: \['suspend'\].*never at random"),
    ('[[faults]]\nkind = "corrupt"\ntarget = "stage1"\nat_step = 5\nmode = "twice"\n',
     r"#1\.mode: 'twice' is not one of persist, once"),
    ('[[faults]]\nkind = "kill"\ntarget = "stage1"\nat_step = 5\nmode = "once"\n',
     r"#1\.mode: only a corrupt fault takes a mode"),
    ('[random]\nkinds = ["kill", "corrupt"]\n', r"\[random\]\.kinds: \['corrupt'\].*never at random"),
    ('[job.settings]\nLM_VARIANT = ["pipeline"]\n', r"\[job\]\.settings\.LM_VARIANT: a setting is a string or a number"),
    ('[job.settings]\nLM_BIG = true\n', r"\[job\]\.settings\.LM_BIG: a setting is a string or a number, got True"),
])
def test_a_bad_scenario_is_refused_naming_the_field(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_scenario(write(tmp_path, body))


def test_a_fault_may_last_until_a_step_instead_of_a_duration(tmp_path: Path) -> None:
    (f,) = load_scenario(write(tmp_path, '[[faults]]\nkind = "tenant"\ntarget = "w1"\nat_step = 2\n'
                                         'until_step = 50\n')).faults
    assert (f.until_step, f.duration_s) == (50, 0.0)
    assert f.describe() == "tenant w1 at step 2 until step 50"


def test_a_corrupt_fault_is_parsed_with_its_mode_persist_by_default(tmp_path: Path) -> None:
    first, second = load_scenario(write(tmp_path, '[[faults]]\nkind = "corrupt"\ntarget = "stage1"\nat_step = 5\n'
                                                  '[[faults]]\nkind = "corrupt"\ntarget = "fwd2"\nat_step = 7\n'
                                                  'mode = "once"\n')).faults
    assert (first.kind, first.target, first.at_step, first.mode) == ("corrupt", "stage1", 5, "persist")
    assert second.mode == "once" and second.describe() == "corrupt fwd2 at step 7 (once)"


def test_a_suspend_is_parsed_with_its_resume_delay_and_needs_checkpoints(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, '[[faults]]\nkind = "kill"\ntarget = "stage2"\nat_step = 12\n'
                                      '[[faults]]\nkind = "suspend"\nat_step = 12\nresume_after_s = 2.5\n'
                                      '[[faults]]\nkind = "suspend"\nat_s = 20\n'))
    kill, first, second = s.faults
    assert (first.kind, first.target, first.at_step, first.resume_after_s, first.duration_s) == ("suspend", "", 12, 2.5, 0.0)
    assert (second.at_s, second.resume_after_s) == (20.0, 1.0)  # the default delay
    assert kill.resume_after_s is None and "suspend" in s.kinds
    assert first.describe() == "suspend at step 12, resumed 2.5s after"
    assert load_scenario(write(tmp_path, '[[faults]]\nkind = "suspend"\nat_step = 3\nresume_after_s = 0\n'
                               )).faults[0].resume_after_s == 0.0
    shipped = load_scenario(ROOT / "scenarios" / "suspend-resume.toml")
    assert [f.kind for f in shipped.faults] == ["kill", "suspend", "leader_kill"]
    assert shipped.coordinators >= 2 and shipped.expect_outcome == "finished"
    p = tmp_path / "no-checkpoints.toml"
    p.write_text('[job]\nfile = "examples/pipeline_mlp.py"\ncheckpoint_every = 0\n'
                 '[[faults]]\nkind = "suspend"\nat_step = 5\n')
    with pytest.raises(ConfigError, match=r"checkpoint_every = 0 keeps no checkpoints"):
        load_scenario(p)


def test_the_compilation_cache_is_on_unless_the_scenario_turns_it_off(tmp_path: Path) -> None:
    assert load_scenario(write(tmp_path, "")).compile_cache is True
    assert load_scenario(write(tmp_path, "[cluster]\ncompile_cache = false\n")).compile_cache is False


def test_unreadable_or_invalid_toml_is_refused_with_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read scenario"):
        load_scenario(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed\n")
    with pytest.raises(ConfigError, match=f"scenario {bad} is not valid TOML"):
        load_scenario(bad)


def test_outcome_checks_state_reason_and_time_bound() -> None:
    assert check_outcome("finished", "", 10, expect="finished", expect_reason="", time_bound_s=60).ok
    assert not check_outcome("finished", "", 70, expect="finished", expect_reason="", time_bound_s=60).ok
    assert check_outcome("failed", "lost slice 's1'", 5, expect="failed", expect_reason="lost slice", time_bound_s=60).ok
    late = check_outcome("failed", "timed out", 5, expect="failed", expect_reason="lost slice", time_bound_s=60)
    assert not late.ok and "does not match" in late.evidence


def test_a_scenarios_job_settings_reach_its_program_as_rallypoint_run_set_gives_them() -> None:
    """``[job] settings`` are the job's ``--set NAME=VALUE``: lm-storm runs the LM's pipeline layout, whose random
    faults target its two stages (the job file's default is the one-slice dp layout)."""
    from rallypoint.chaos.campaign import job_slices

    storm = load_scenario(ROOT / "scenarios" / "lm-storm.toml")
    assert dict(storm.settings) == {"LM_VARIANT": "pipeline", "LM_EVAL_EVERY": "0"}
    assert job_slices(storm) == ["stage0", "stage1"]
    assert job_slices(replace(storm, settings=())) == ["dp"]
