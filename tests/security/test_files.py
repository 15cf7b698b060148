"""Files and names on the shared file system, and the code bundle a worker unpacks (docs/security.md, items
"Code bundles" and "Files on the shared file system"): what another host can plant there is refused, not used.

No processes: the service runs on a MemoryStore with stand-in executors (tests/fakes_service.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import zipfile
from pathlib import Path
from typing import Any

import grpc
import pytest

from rallypoint.basics.errors import ConfigError
from rallypoint.orchestrator.job.runs import JOBSPEC_FILE, LATEST_FILE, check_spec_names, run_dir
from rallypoint.orchestrator.job.state import JobFailed
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers import code as code_mod
from rallypoint.workers.code import CodeCache, CodeError
from tests.fakes_service import Aborted, Context, StandInExecutor, service_with_stand_ins


def zipped(entries: dict[str, bytes], *, attrs: dict[str, int] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = (attrs or {}).get(name, 0o644 << 16)
            z.writestr(info, data)
    return buf.getvalue()


def planted(run: Path, data: bytes) -> str:
    sha = hashlib.sha256(data).hexdigest()
    (run / "code").mkdir(parents=True, exist_ok=True)
    (run / "code" / f"{sha}.zip").write_bytes(data)
    return sha


# -- the code bundle (a worker unpacks what it hashed, bounded) ------------------------------------------------


def test_a_bundle_swapped_after_its_hash_was_checked_is_not_unpacked(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    good, evil = zipped({"job.py": b"x = 1\n"}), zipped({"job.py": b"import os; os.system('steal the keys')\n"})
    sha = planted(tmp_path / "run", good)
    real = hashlib.sha256

    def sha256_then_swap(data: bytes = b"") -> Any:  # another host rewrites the file just after the check read it
        (tmp_path / "run" / "code" / f"{sha}.zip").write_bytes(evil)
        return real(data)

    monkeypatch.setattr(code_mod.hashlib, "sha256", sha256_then_swap)
    unpacked = CodeCache(tmp_path / "cache").get(tmp_path / "run", sha)
    assert (unpacked / "job.py").read_bytes() == b"x = 1\n"  # the bytes hashed, not the ones planted after


def test_a_bundle_over_the_unpacked_size_cap_is_refused_naming_it_and_the_cap(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(code_mod, "MAX_UNPACKED_BYTES", 1 << 20, raising=False)
    bomb = zipped({"data.bin": bytes(3 << 20)})  # 3 MiB of zeros in a few KiB
    assert len(bomb) < 64 << 10
    sha = planted(tmp_path / "run", bomb)
    with pytest.raises(CodeError, match=rf"{sha}\.zip unpacks to {3 << 20} bytes, over the limit of {1 << 20}"):
        CodeCache(tmp_path / "cache").get(tmp_path / "run", sha)
    assert not list((tmp_path / "cache").rglob("data.bin"))


def test_a_bundle_over_the_entry_cap_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(code_mod, "MAX_ENTRIES", 10, raising=False)
    sha = planted(tmp_path / "run", zipped({f"m{i}.py": b"" for i in range(11)}))
    with pytest.raises(CodeError, match=rf"{sha}\.zip has 11 entries, over the limit of 10"):
        CodeCache(tmp_path / "cache").get(tmp_path / "run", sha)


@pytest.mark.parametrize("name,attr", [("link.py", (stat.S_IFLNK | 0o777) << 16), ("/etc/evil.py", 0o644 << 16),
                                       ("a/../../evil.py", 0o644 << 16)])
def test_a_bundle_entry_that_escapes_its_folder_is_refused(tmp_path: Path, name: str, attr: int) -> None:
    sha = planted(tmp_path / "run", zipped({"job.py": b"", name: b"/root/.ssh"}, attrs={name: attr}))
    with pytest.raises(CodeError, match="outside its root|not a plain file or folder"):
        CodeCache(tmp_path / "cache").get(tmp_path / "run", sha)


def test_an_unpacked_bundle_is_read_only(tmp_path: Path) -> None:
    sha = planted(tmp_path / "run", zipped({"pkg/job.py": b"x = 1\n"}))
    unpacked = CodeCache(tmp_path / "cache").get(tmp_path / "run", sha)
    assert stat.S_IMODE((unpacked / "pkg" / "job.py").stat().st_mode) == 0o444
    assert stat.S_IMODE((unpacked / "pkg").stat().st_mode) == 0o555
    assert stat.S_IMODE(unpacked.stat().st_mode) == 0o555


def test_a_bundle_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    data = zipped({"job.py": b""})
    sha = hashlib.sha256(data).hexdigest()
    (tmp_path / "elsewhere.zip").write_bytes(data)
    (tmp_path / "run" / "code").mkdir(parents=True)
    (tmp_path / "run" / "code" / f"{sha}.zip").symlink_to(tmp_path / "elsewhere.zip")
    with pytest.raises(CodeError, match="is a symlink"):
        CodeCache(tmp_path / "cache").get(tmp_path / "run", sha)


# -- names that become files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("node", ["../../../etc/cron.d/x", "a/b", ".hidden", ""])
def test_a_submitted_node_name_that_is_not_a_plain_name_is_refused(node: str) -> None:
    spec = pb.JobSpec(job="j")
    spec.nodes.add(name=node, slice="s0")
    with pytest.raises(ConfigError, match="invalid node name"):
        check_spec_names(spec)


# -- LATEST, jobspec.pb, the run directory ----------------------------------------------------------------------


def a_run(root: Path, job: str = "a") -> Path:
    rd = root / job / "run-20260101T000000-abcdef"
    rd.mkdir(parents=True)
    (rd / JOBSPEC_FILE).write_bytes(pb.JobSpec(job=job, steps=3).SerializeToString())
    (root / job / LATEST_FILE).write_text(rd.name + "\n")
    return rd


def test_a_latest_that_is_a_symlink_or_not_a_plain_file_is_refused(tmp_path: Path) -> None:
    rd = a_run(tmp_path)
    latest = tmp_path / "a" / LATEST_FILE
    (tmp_path / "planted").write_text(rd.name + "\n")
    latest.unlink()
    latest.symlink_to(tmp_path / "planted")  # a host points LATEST elsewhere (/dev/zero would exhaust memory)
    with pytest.raises(JobFailed, match="LATEST .* is a symlink"):
        run_dir(tmp_path, "a", create=False)
    latest.unlink()
    latest.symlink_to("/dev/zero")
    with pytest.raises(JobFailed, match="is a symlink"):
        run_dir(tmp_path, "a", create=False)
    latest.unlink()
    latest.write_bytes(b"x" * 4096)
    with pytest.raises(JobFailed, match="over its limit of 256"):
        run_dir(tmp_path, "a", create=False)


@pytest.mark.parametrize("at", ["the job folder", "the run directory"])
def test_a_job_folder_swapped_for_a_symlink_while_its_run_is_made_is_refused(tmp_path: Path, at: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A host swaps ``<root>/<job>`` for a symlink out of the root after it was checked, just before a folder is
    made (the job's, or the run's in it): no run directory is made outside the root."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    base, mkdir = root / "a", Path.mkdir

    def swap_then_mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if (self == base if at == "the job folder" else self.parent == base) and not base.is_symlink():
            os.rename(base, tmp_path / "moved")
            base.symlink_to(outside)
        mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", swap_then_mkdir)
    try:
        made = run_dir(root, "a", create=True, run="run-20260101T000000-abcdef")
    except (ConfigError, JobFailed) as exc:
        assert "symlink" in str(exc) or "outside" in str(exc) or "lies at" in str(exc), exc
        made = None
    assert list(outside.iterdir()) == [], "the run directory was made outside the checkpoint root"
    assert made is None or root.resolve() in made.parents


def bound(c: Any, rd: Path, job: str = "a", state: str = "failed", term: int = 3) -> str:
    """The job record a leader wrote for run ``rd``: it binds the run's jobspec.pb as it is now."""
    sha = hashlib.sha256((rd / JOBSPEC_FILE).read_bytes()).hexdigest()
    c.store.put(c.keys.job(job), json.dumps({"job": job, "state": state, "term": term, "run": rd.name,
                                             "run_dir": str(rd), "spec_sha256": sha}))
    return sha


def test_resume_and_adoption_refuse_a_job_spec_changed_on_the_shared_file_system(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    svc, c = service_with_stand_ins(monkeypatch, tmp_path)
    rd = a_run(tmp_path)
    bound(c, rd)
    evil = pb.JobSpec(job="a", steps=3)
    evil.code.sha256 = "e" * 64  # a host points every worker at code of its own
    (rd / JOBSPEC_FILE).write_bytes(evil.SerializeToString())
    with pytest.raises(Aborted) as err:
        next(iter(svc.ResumeJob(pb.ResumeRequest(job="a"), Context())))
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert f"the job spec {rd / JOBSPEC_FILE} hashes to" in err.value.details and "changed outside" in err.value.details
    record = json.loads(c.store.get(c.keys.job("a")).value)
    c.store.put(c.keys.job("a"), json.dumps({**record, "state": "running"}))  # as a new leader finds it
    svc.adoption.adopt_all(7)
    assert StandInExecutor.made == []


def test_resume_refuses_a_latest_naming_another_run_than_the_record(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    svc, c = service_with_stand_ins(monkeypatch, tmp_path)
    rd = a_run(tmp_path)
    bound(c, rd)
    other = tmp_path / "a" / "run-20260202T000000-fedcba"  # a run a host made, with a spec of its own
    other.mkdir()
    (other / JOBSPEC_FILE).write_bytes(pb.JobSpec(job="a", steps=99).SerializeToString())
    (tmp_path / "a" / LATEST_FILE).write_text(other.name + "\n")
    with pytest.raises(Aborted) as err:
        next(iter(svc.ResumeJob(pb.ResumeRequest(job="a"), Context())))
    assert "names run 'run-20260202T000000-fedcba', but the job's record in etcd names run" in err.value.details
    assert StandInExecutor.made == []


def test_a_bound_job_spec_resumes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    svc, c = service_with_stand_ins(monkeypatch, tmp_path)
    c.election.fenced_txn = lambda *a, **k: None
    bound(c, a_run(tmp_path))
    next(iter(svc.ResumeJob(pb.ResumeRequest(job="a"), Context())), None)
    assert len(StandInExecutor.made) == 1
