"""The files of a run the coordinator trusts, on a checkpoint root every worker host can write.

A run directory's ``jobspec.pb`` (the spec a resume or a new leader runs, with the code
bundle's sha256 in it) and the job's ``LATEST`` (which run is newest) lie on the shared file
system, where any worker host could replace them. So:

* they are read with :func:`~rallypoint.basics.trusted_files.read_bounded`: no symlink followed,
  a regular file only, at most :data:`MAX_SPEC_BYTES` / :data:`MAX_LATEST_BYTES` (a ``LATEST``
  symlinked to ``/dev/zero`` is refused, not read until memory runs out);
* the job spec is bound to etcd: the job record (``jobs/<job>``, written by the leader only)
  keeps the sha256 of the ``jobspec.pb`` its run wrote (``spec_sha256``), and a resume or an
  adoption checks the file against it before using it, and follows ``LATEST`` only to the run
  the record names. The code bundle is bound through the spec: it names the bundle's sha256,
  which every worker checks the zip against (``workers/code.py``);
* a new run directory is made under the job's folder opened with ``O_NOFOLLOW`` (a symlink
  swapped in for the folder after its check is refused, not written through), then checked to lie
  in the root; ``LATEST`` and ``jobspec.pb`` are written as fresh files (``O_EXCL``), then renamed.

A record written before this binding (no ``spec_sha256``), or none at all (a new etcd), leaves
the files trusted as they are: docs/security.md says so.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from rallypoint.basics.errors import ConfigError
from rallypoint.basics.trusted_files import read_bounded, write_new
from rallypoint.orchestrator.job.state import JobFailed

JOBSPEC_FILE = "jobspec.pb"
LATEST_FILE = "LATEST"
MAX_SPEC_BYTES = 256 * 2**20
"""The largest ``jobspec.pb`` read (a submit is at most 256 MiB, and its code bundle is kept apart)."""
MAX_LATEST_BYTES = 256
"""The largest ``LATEST`` read: a run id and a newline."""


def read_latest(job_dir: Path) -> str:
    """The run id ``<job_dir>/LATEST`` names (stripped, unchecked). FileNotFoundError when there is none;
    JobFailed when it is a symlink, not a plain file or too large."""
    try:
        return read_bounded(job_dir / LATEST_FILE, MAX_LATEST_BYTES, "the job's LATEST").decode().strip()
    except (ConfigError, UnicodeDecodeError) as exc:
        raise JobFailed(str(exc)) from None


def bound_run(record: dict[str, Any] | None, run: str, latest: Path) -> None:
    """Refuse a ``LATEST`` naming another run than the job record (the leader's) does, when that record is bound
    (has ``spec_sha256``): a host that can write the checkpoint root must not pick the run a resume continues."""
    if not record or not record.get("spec_sha256"):
        return
    recorded = str(record.get("run") or "")
    if recorded and recorded != run:
        raise JobFailed(f"{latest} names run {run!r}, but the job's record in etcd names run {recorded!r}: the file "
                        "was changed outside the coordinators; write the recorded run id back into it (or delete "
                        "the job's record to trust the files as they are), then resume again")


def read_spec(run_dir: Path, record: dict[str, Any] | None) -> bytes:
    """The bytes of ``<run_dir>/jobspec.pb``, checked against the job record's ``spec_sha256`` when the record is
    of this run and has one. JobFailed naming the file when it is a symlink, too large, or hashes otherwise."""
    path = run_dir / JOBSPEC_FILE
    try:
        data = read_bounded(path, MAX_SPEC_BYTES, "the job spec")
    except ConfigError as exc:
        raise JobFailed(str(exc)) from None
    want = str((record or {}).get("spec_sha256") or "")
    if want and str((record or {}).get("run") or "") == run_dir.name:
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            raise JobFailed(f"the job spec {path} hashes to {got}, but the run wrote one of sha256 {want} (the job's "
                            "record in etcd): it was changed outside the coordinators, and is not run; restore the "
                            "file, or submit the job again as a new run (--new-run)")
    return data


def spec_digest(run_dir: Path, record: dict[str, Any] | None) -> str:
    """The ``spec_sha256`` a resumed run's record keeps: the record's, when it is of this run, else the file's."""
    if record and record.get("spec_sha256") and str(record.get("run") or "") == run_dir.name:
        return str(record["spec_sha256"])
    return hashlib.sha256(read_spec(run_dir, None)).hexdigest()


def make_run_dir(root: Path, job_dir: Path, name: str) -> Path:
    """Make the run directory ``<job_dir>/<name>`` and point ``LATEST`` at it; ``job_dir`` is ``<root>/<job>``.

    The job's folder is opened without following a symlink and the run directory made and ``LATEST`` written
    through that handle, then the new directory is checked to lie in ``root``. ConfigError if anything leads out.
    """
    job_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError(f"the job folder {job_dir} cannot be opened as a folder ({exc}): a symlink or a file "
                          "took its place; checkpoints go only under the root the coordinators were started "
                          "with") from None
    try:
        real = Path(os.path.realpath(f"/proc/self/fd/{fd}")) if os.path.isdir("/proc/self/fd") else job_dir.resolve()
        base = root.resolve()
        if real.parent != base:
            raise ConfigError(f"the job folder {job_dir} lies at {real}, not in the checkpoint root {base}: "
                              "checkpoints go only under the root the coordinators were started with")
        os.mkdir(name, 0o755, dir_fd=fd)
        write_new(fd, LATEST_FILE, (name + "\n").encode())
    finally:
        os.close(fd)
    return real / name


def write_spec(run_dir: Path, data: bytes) -> str:
    """Write ``jobspec.pb`` into the new run directory (a fresh file, not through a planted one); its sha256."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        write_new(fd, JOBSPEC_FILE, data)
    finally:
        os.close(fd)
    return hashlib.sha256(data).hexdigest()
