"""`rallypoint run`'s integrity options (client/commands/integrity.py): refused before anything starts when
wrong, carried to the job spec when right, and the lines the progress output prints for spikes, rollbacks
and verifications; a rollback's marks on the plot (docs/integrity.md)."""

from __future__ import annotations

from click.testing import CliRunner

from rallypoint.client.commands.main import main
from rallypoint.client.commands.output import describe_event
from rallypoint.client.compile import compile_program
from rallypoint.client.jobspec import job_spec
from rallypoint.orchestrator.job.metrics import parse_metrics
from tests.examples import example
from tests.helpers.cli import ROOT

JOB = str(ROOT / "examples" / "urgent.py")


def test_bad_spike_settings_and_a_skip_without_reference_are_refused_naming_the_option() -> None:
    r = CliRunner().invoke(main, ["run", JOB, "--on-spike", "rollback", "--spike-factor", "0.5"])
    assert r.exit_code == 1 and "--spike-factor: spike_factor must be > 1" in r.output, r.output
    r = CliRunner().invoke(main, ["run", JOB, "--skip", "3:2"])
    assert r.exit_code == 1 and "--skip is for --reference" in r.output, r.output
    r = CliRunner().invoke(main, ["run", JOB, "--reference", "--skip", "3"])
    assert r.exit_code == 1 and "--skip: skip '3' is not START:COUNT" in r.output, r.output
    r = CliRunner().invoke(main, ["run", JOB, "--on-spike", "rollback", "--spike-rewind", "40", "--keep-checkpoints",
                                  "2", "--checkpoint-every", "10", "--steps", "4"])
    assert r.exit_code == 1 and "keep at least 6 checkpoints" in r.output, r.output


def test_the_settings_reach_the_job_spec() -> None:
    spec = job_spec(compile_program(example("urgent").build(steps=4)), on_spike="rollback", spike_window=5,
                    spike_rewind=3, spike_skip=2, max_rollbacks=4, verify_every=2, verify_seed=7)
    assert (spec.on_spike, spec.spike_window, spec.spike_rewind, spec.spike_skip, spec.max_rollbacks,
            spec.verify_every, spec.verify_seed) == ("rollback", 5, 3, 2, 4, 2, 7)


def test_the_progress_lines_of_a_spike_a_rollback_and_a_conviction() -> None:
    spike = describe_event({"event": "job.spike", "step": 9, "metric": "loss", "value": 68.7, "baseline": 0.3,
                            "threshold": 0.9, "action": "rollback"})
    assert "loss spike" in spike and "at step 9" in spike and "rolling back" in spike
    back = describe_event({"event": "job.rolled_back", "step": 9, "cut": 6, "skipped_steps": [6, 11], "rollback": 1})
    assert "to the cut at step 6" in back and "steps 6..10" in back
    sdc = describe_event({"event": "job.sdc", "verdict": "convicted", "suspect": "w0", "slice": "a", "from_step": 0,
                          "to_step": 10, "trusted_cut": 0})
    assert "silent data corruption" in sdc and "worker w0" in sdc and "cordoned suspect-sdc" in sdc


def test_a_rollback_is_marked_on_the_plot_and_the_curve_keeps_the_steps_run_again() -> None:
    lines = ['{"step": 8, "t": 1, "metrics": {"loss": 0.3}}', '{"step": 9, "t": 2, "metrics": {"loss": 68.7}}',
             '{"event": "spike", "t": 2, "step": 9, "metric": "loss", "value": 68.7, "action": "rollback"}',
             '{"event": "rollback", "rollback": 1, "t": 3, "step": 9, "from_step": 6, "skipped_steps": [6, 11]}',
             '{"step": 9, "t": 4, "metrics": {"loss": 0.2}}']
    run = parse_metrics(lines)
    assert run.curve("loss") == [(8, 0.3), (9, 0.2)]
    assert [(m["kind"], m["label"]) for m in run.plot_marks()] == [
        ("spike", "spike loss 68.7"), ("rollback", "rolled back to 6, skipped 6..10")]
