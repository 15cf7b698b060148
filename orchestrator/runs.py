"""A job's runs on disk: each submit of a job starts a run directory under the checkpoint root.

``ROOT/JOB/run-<time>-<id>/`` holds the run's checkpoints, its commit records and the
job spec it ran (``jobspec.pb``, what a new leader adopts from); ``ROOT/JOB/LATEST``
names the newest run, the one ``resume`` and adoption continue.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from rallypoint.orchestrator.job_state import JobFailed

JOBSPEC_FILE = "jobspec.pb"
LATEST_FILE = "LATEST"


def run_dir(root: Path, job: str, *, create: bool) -> Path:
    """The checkpoint directory of the job's newest run under ``root`` (a new one when ``create``)."""
    base = root / job
    if create:
        name = time.strftime("run-%Y%m%dT%H%M%S-") + uuid.uuid4().hex[:6]
        (base / name).mkdir(parents=True)
        (base / LATEST_FILE).write_text(name + "\n")
        return base / name
    latest = base / LATEST_FILE
    if not latest.exists():
        raise JobFailed(f"no run of job {job!r} under {root}: nothing to resume (is --checkpoint-dir right?)")
    return base / latest.read_text().strip()
