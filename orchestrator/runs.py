"""A job's runs on disk: each submit of a job starts a run directory under the checkpoint root.

``ROOT/JOB/run-<time>-<id>/`` holds the run's checkpoints, its commit records and the
job spec it ran (``jobspec.pb``, what a new leader adopts from); ``ROOT/JOB/LATEST``
names the newest run, the one ``resume`` and adoption continue.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

from rallypoint.orchestrator.job_state import JobFailed

JOBSPEC_FILE = "jobspec.pb"
LATEST_FILE = "LATEST"
_RUN_NAME = re.compile(r"run-[0-9T]{15}-[0-9a-f]{6}")


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
    name = latest.read_text().strip()
    run = base / name
    # LATEST is read from disk: it must name one run directory of this job, not a path elsewhere.
    if not _RUN_NAME.fullmatch(name) or run.is_symlink() or not run.resolve().is_relative_to(base.resolve()):
        raise JobFailed(f"{latest} names {name!r}, not a run directory of job {job!r} (run-<time>-<id> in "
                        f"{base}): fix or remove that file, then resume again")
    return run
