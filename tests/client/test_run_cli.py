"""`rallypoint run`: the reference run from the command line, and bad job files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rallypoint.client.reference import run_reference
from tests.examples import example
from tests.helpers.cli import ROOT, rp


@pytest.mark.processes
def test_run_reference_json_ends_with_the_finished_line_and_the_same_digest(tmp_path: Path) -> None:
    r = rp("run", "--reference", "--json", "--steps", "3", str(ROOT / "examples" / "rl_loop.py"),
           "--tensorboard", str(tmp_path / "tb"))
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert [e["step"] for e in events[:-1]] == [0, 1, 2]
    assert all("loss" in e["metrics"] and "reward" in e["metrics"] for e in events[:-1])
    final = events[-1]
    assert final["event"] == "job.finished" and final["job"] == "rl-loop" and final["steps"] == 3
    assert set(final) == {"event", "job", "steps", "state_digest", "wall_s"}
    assert final["state_digest"] == run_reference(example("rl_loop").build(steps=3)).state_digest
    from rallypoint.orchestrator.job.tfevents import read_events  # --tensorboard: this process wrote the steps

    (f,) = (tmp_path / "tb" / "rl-loop" / "reference").glob("events.out.tfevents.*")
    assert [(e.step, sorted(e.tags)) for e in read_events(f)][1:] == [(s, ["loss", "reward"]) for s in range(3)]


@pytest.mark.processes
def test_run_reference_shows_progress_and_the_digest() -> None:
    r = rp("run", "--reference", "--steps", "2", str(ROOT / "examples" / "data_parallel.py"))
    assert "data-parallel: 2 steps" in r.stdout and "state digest" in r.stdout


@pytest.mark.processes
def test_bad_job_files_get_a_clear_message_and_a_nonzero_exit(tmp_path: Path) -> None:
    cases = {
        "missing.py": (None, "not found"),
        "broken.py": ("import no_such_module_here\n", "failed to import: ModuleNotFoundError"),
        "empty.py": ("x = 1\n", "defines no Program"),
        "cyclic.py": (
            "from rallypoint.client import Program\n"
            "p = Program('cyc', steps=1)\n"
            "s = p.slice('s')\n"
            "from rallypoint.client.program import Ref\n"
            "p.node('a', lambda x: x, slice=s, inputs={'x': Ref('b', 'out')})\n"
            "p.node('b', lambda x: x, slice=s, inputs={'x': Ref('a', 'out')})\n"
            "program = p\n",
            "cycle within a step: a -> b -> a",
        ),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        r = rp("run", "--reference", str(path), check=False)
        assert r.returncode == 1, (name, r.stdout, r.stderr)
        assert message in r.stderr, (name, r.stderr)
        assert "Traceback" not in r.stderr
    r = rp("run", "--reference", "--steps", "0", str(ROOT / "examples" / "rl_loop.py"), check=False)
    assert r.returncode == 1 and "--steps must be a positive integer" in r.stderr


@pytest.mark.processes
def test_a_straggler_factor_of_one_or_less_is_refused_before_anything_runs() -> None:
    r = rp("run", "--reference", "--straggler-factor", "1", str(ROOT / "examples" / "rl_loop.py"), check=False)
    assert r.returncode == 1 and "--straggler-factor must be > 1" in r.stderr and "Traceback" not in r.stderr
    r = rp("run", "--reference", "--stragglers", "sometimes", str(ROOT / "examples" / "rl_loop.py"), check=False)
    assert r.returncode == 2 and "'sometimes' is not one of 'migrate', 'report', 'off'" in r.stderr


def test_a_straggler_decision_is_one_line_with_its_numbers() -> None:
    from rallypoint.client.commands.output import describe_event

    line = describe_event({"event": "job.straggler", "slice": "stage3", "worker": "w3", "decision": "migrate",
                      "reason": "moving slices ['stage3'] off worker w3 by drain 1",
                      "evidence": {"slices": {"stage3": {"slowdown": 3.48, "peers_slowdown": 1.23}}}})
    assert line == ("[yellow]straggler[/yellow] stage3 on w3 (3.5x its baseline, peers 1.2x): migrate: "
                    "moving slices ['stage3'] off worker w3 by drain 1")


def test_a_corrupt_fault_and_the_digest_comparison_are_one_line_each() -> None:
    from rallypoint.client.commands.output import describe_event

    armed = describe_event({"event": "fault.injected", "fault": "corrupt:a@3", "slice": "a", "worker": "w0",
                            "step": 3, "mode": "persist", "armed": True})
    assert armed == "[red]fault[/red] corrupt:a@3: worker w0 flips a bit of a's state at every state update from " \
                    "step 3 (silently)"
    differs = describe_event({"event": "digest.compared", "state_digest": "ab", "reference_digest": "cd",
                              "equal": False})
    assert differs == "[red]state digest ab differs from the in-process reference's cd[/red]: the corruption " \
                      "went undetected"
    assert "equals" in describe_event({"event": "digest.compared", "state_digest": "ab", "equal": True})


def test_the_failure_policy_options_reach_the_job_spec_and_bad_values_are_refused_naming_them() -> None:
    from click.testing import CliRunner

    from rallypoint.client.commands.main import main
    from rallypoint.client.compile import compile_program
    from rallypoint.client.jobspec import job_spec
    from tests.examples import example

    for option, value in (("--max-faults", "0"), ("--max-preemptions", "-1"), ("--failure-window-s", "0"),
                          ("--compile-timeout-s", "-5")):
        r = CliRunner().invoke(main, ["run", "--reference", option, value, str(ROOT / "examples" / "rl_loop.py")])
        assert r.exit_code == 1 and f"{option} must be positive, got {value}" in r.output, (option, r.output)
    spec = job_spec(compile_program(example("rl_loop").build(steps=2)), max_faults=3, max_preemptions=7,
                    failure_window_s=120.0, compile_timeout_s=900.0)
    assert (spec.max_faults, spec.max_preemptions, spec.failure_window_s, spec.compile_timeout_s) == (3, 7, 120, 900)
