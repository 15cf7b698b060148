"""The runs an embedded `rallypoint run` keeps under STATE_DIR/runs: --rm and --keep-runs once it succeeded."""

from __future__ import annotations

from pathlib import Path

from rallypoint.client.commands.kept_runs import EmbeddedRuns, runs_root, settle

RUNS = [f"run-2026120{d}T000000-abcdef" for d in range(1, 5)]


def runs_of(root: Path, job: str = "j") -> Path:
    for r in RUNS:
        (root / job / r / "commits").mkdir(parents=True)
    (root / job / "LATEST").write_text(RUNS[-1] + "\n")
    return root / job


def test_by_default_every_run_is_kept_and_the_newest_is_named(tmp_path: Path) -> None:
    job = runs_of(tmp_path)
    assert settle(tmp_path, "j", EmbeddedRuns()) == (job / RUNS[-1], [])
    assert sorted(p.name for p in job.iterdir()) == ["LATEST", *RUNS]
    assert runs_root(tmp_path / "state") == (tmp_path / "state" / "runs").absolute()


def test_keep_runs_deletes_the_oldest_beyond_n_never_the_current(tmp_path: Path) -> None:
    job = runs_of(tmp_path)
    kept, gone = settle(tmp_path, "j", EmbeddedRuns(keep=2))
    assert kept == job / RUNS[-1] and gone == RUNS[:2]
    assert sorted(p.name for p in job.iterdir()) == ["LATEST", *RUNS[2:]]


def test_rm_deletes_this_run_and_latest_names_the_newest_left(tmp_path: Path) -> None:
    job = runs_of(tmp_path)
    assert settle(tmp_path, "j", EmbeddedRuns(remove=True)) == (None, [RUNS[-1]])
    assert (job / "LATEST").read_text().strip() == RUNS[-2] and not (job / RUNS[-1]).exists()
    only = runs_of(tmp_path / "one", "k")
    for r in RUNS[:-1]:
        (only / r / "commits").rmdir()
        (only / r).rmdir()
    assert settle(tmp_path / "one", "k", EmbeddedRuns(remove=True)) == (None, [RUNS[-1]])
    assert not (only / "LATEST").exists()
    assert settle(tmp_path, "none", EmbeddedRuns(remove=True)) == (None, [])  # no run of that job: nothing
