"""Where an embedded ``rallypoint run`` keeps its runs: ``STATE_DIR/runs/<job>/<run>/``.

The embedded cluster lives in a temporary folder and goes with the command; its coordinators
are given ``STATE_DIR/runs`` (``RALLYPOINT_STATE_DIR``, default ``.rallypoint``) as their
checkpoint root, so each run's directory (checkpoints with the final cut, ``metrics.jsonl``,
``events.jsonl``, the code bundle, the job spec) outlives it, laid out as on a cluster
(``LATEST`` names the newest run). ``rallypoint export``, ``rallypoint plot`` and
``rallypoint.client.load_state`` read it there. ``--rm`` deletes the run once it succeeded;
``--keep-runs N`` deletes the job name's runs older than its newest N, as a cluster's
coordinators do (``--keep-runs``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rallypoint.client.commands.clusters import DEFAULT_STATE_DIR

RUNS = "runs"
LATEST = "LATEST"


@dataclass(frozen=True)
class EmbeddedRuns:
    """What happens to an embedded run's directory once the job succeeded: deleted (``remove``), or kept with the
    job name's newest ``keep`` runs (0: all)."""

    remove: bool = False
    keep: int = 0


def runs_root(state_dir: Path | None = None) -> Path:
    """The embedded runs' checkpoint root: ``STATE_DIR/runs``, absolute."""
    state = state_dir or Path(os.environ.get("RALLYPOINT_STATE_DIR") or DEFAULT_STATE_DIR)
    return (state / RUNS).absolute()


def _runs(job_dir: Path) -> list[Path]:
    """The job name's run directories, oldest first (run ids begin with their start time)."""
    from rallypoint.orchestrator.api import RUN_ID

    return sorted(p for p in job_dir.iterdir() if p.is_dir() and RUN_ID.match(p.name)) if job_dir.is_dir() else []


def settle(root: Path, job: str, runs: EmbeddedRuns) -> tuple[Path | None, list[str]]:
    """After a success: the run kept (None: deleted by ``--rm``, or none found) and the runs deleted."""
    job_dir = root / job
    latest = job_dir / LATEST
    if not latest.is_file():
        return None, []
    current = job_dir / latest.read_text().strip()
    gone: list[str] = []
    if runs.remove:
        shutil.rmtree(current, ignore_errors=True)
        gone.append(current.name)
        rest = _runs(job_dir)
        if rest:
            latest.write_text(rest[-1].name + "\n")
        else:
            latest.unlink(missing_ok=True)
        return None, gone
    if runs.keep:
        older = [p for p in _runs(job_dir) if p != current]
        for p in older[:max(0, len(older) - (runs.keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p.name)
    return current, gone
