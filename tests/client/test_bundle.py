"""The job's code bundle and host source declarations: pure logic, no process."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from rallypoint.client import Program
from rallypoint.client.bundle import pack
from rallypoint.client.compile import compile_program
from rallypoint.client.jobspec import job_spec
from rallypoint.client.program import ProgramError
from rallypoint.basics.errors import ConfigError
from rallypoint.orchestrator.job.runs import check_code, keep_code
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.code import CodeCache, CodeError


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def test_a_bundle_is_the_same_bytes_for_the_same_files_and_leaves_out_caches_and_ignored_paths(tmp_path: Path) -> None:
    files = {"train.py": b"x = 1\n", "lib/model.py": b"y = 2\n", "__pycache__/train.cpython-311.pyc": b"\0",
             ".git/HEAD": b"ref", "data/big.bin": b"0" * 100, "notes.tmp": b"t", ".rallypointignore": b"data\n*.tmp\n"}
    a = pack(tree(tmp_path / "a", files))
    b = pack(tree(tmp_path / "b", files))
    assert a.sha256 == b.sha256 == hashlib.sha256(a.zip).hexdigest()
    names = zipfile.ZipFile(__import__("io").BytesIO(a.zip)).namelist()
    assert names == [".rallypointignore", "lib/model.py", "train.py"]
    (tmp_path / "b" / "train.py").write_bytes(b"x = 3\n")
    assert pack(tmp_path / "b").sha256 != a.sha256


def test_a_bundle_over_its_limit_is_refused_naming_the_largest_files(tmp_path: Path) -> None:
    root = tree(tmp_path, {"train.py": b"x", "tokens.bin": b"0" * 4096})
    with pytest.raises(ProgramError, match=r"holds 0.0 MiB of files, over the limit.*tokens.bin.*\.rallypointignore"):
        pack(root, limit_bytes=1024)
    with pytest.raises(ProgramError, match="is not a directory"):
        pack(tmp_path / "nowhere")


def test_the_coordinator_refuses_a_bundle_whose_bytes_are_not_its_hash_and_keeps_a_good_one(tmp_path: Path) -> None:
    b = pack(tree(tmp_path / "code", {"train.py": b"x = 1\n"}))
    spec = pb.JobSpec(job="j", code=pb.CodeBundle(sha256=b.sha256, zip=b.zip[:-1] + b"!"))
    with pytest.raises(ConfigError, match="hash to .* not to .* damaged on the way"):
        check_code(spec)
    host = pb.JobSpec(job="j", nodes=[pb.NodeProgram(name="batch", host_source=pb.HostSource(file="t.py", name="f"))])
    with pytest.raises(ConfigError, match=r"host sources \['batch'\] need the job's code bundle"):
        check_code(host)
    good = pb.JobSpec(job="j", code=pb.CodeBundle(sha256=b.sha256, zip=b.zip))
    check_code(good)
    keep_code(tmp_path / "run", good)
    assert not good.code.zip and good.code.sha256 == b.sha256  # the spec recorded keeps the hash only
    cache = CodeCache(tmp_path / "cache")
    unpacked = cache.get(tmp_path / "run", b.sha256)
    assert (unpacked / "train.py").read_bytes() == b"x = 1\n"
    assert cache.get(tmp_path / "run", b.sha256) == unpacked  # once per hash


def test_a_worker_refuses_a_changed_bundle_and_an_entry_outside_its_root(tmp_path: Path) -> None:
    b = pack(tree(tmp_path / "code", {"train.py": b"x = 1\n"}))
    (tmp_path / "run" / "code").mkdir(parents=True)
    (tmp_path / "run" / "code" / f"{b.sha256}.zip").write_bytes(b.zip + b"more")
    with pytest.raises(CodeError, match="hashes to .* not to .* changed after the submit"):
        CodeCache(tmp_path / "c1").get(tmp_path / "run", b.sha256)
    evil = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil, "w") as z:
        z.writestr("../outside.py", "x = 1\n")
    data = evil.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    (tmp_path / "run" / "code" / f"{sha}.zip").write_bytes(data)
    with pytest.raises(CodeError, match="outside its root"):
        CodeCache(tmp_path / "c2").get(tmp_path / "run", sha)
    assert not (tmp_path / "outside.py").exists() and not (tmp_path / "c2" / "outside.py").exists()


def module_source(step: int, microbatch: int) -> dict[str, np.ndarray]:
    return {"x": np.full((4,), step, np.float32)}


def host_program(fn) -> Program:  # type: ignore[no-untyped-def]
    prog = Program("host", steps=3)
    s = prog.slice("s")
    total = prog.state("total", slice=s, init=lambda: jnp.zeros((4,)))
    src = prog.source("data", fn, slice=s, per="step", outputs=("x",), host=True)
    prog.node("add", lambda total, x: {"total": total + x}, slice=s, inputs={"total": total, "x": src["x"]},
              outputs=("total",), updates={"total": total})
    return prog


def test_a_host_source_is_shipped_by_its_module_level_name_with_the_job_files_directory() -> None:
    spec = job_spec(compile_program(host_program(module_source)))
    (node,) = [n for n in spec.nodes if n.HasField("host_source")]
    assert node.host_source.name == "module_source"
    assert node.host_source.file.endswith("test_bundle.py") and not node.host_source.file.startswith("/")
    assert spec.code.sha256 == hashlib.sha256(spec.code.zip).hexdigest()


def test_a_host_source_that_is_not_a_module_level_name_or_returns_no_arrays_is_refused_at_compile() -> None:
    def local(step: int, microbatch: int) -> dict[str, np.ndarray]:
        return {"x": np.zeros((4,), np.float32)}

    with pytest.raises(ProgramError, match="host source 'data': its function must be reachable by a module-level name"):
        compile_program(host_program(local))
    global text_source

    def text_source(step: int, microbatch: int) -> dict[str, object]:
        return {"x": np.array(["a", "b"])}

    with pytest.raises(ProgramError, match=r"host source 'data' \(output 'x'\) returned a leaf of dtype <U1"):
        compile_program(host_program(text_source))


def test_a_jax_source_that_ignores_step_and_microbatch_is_refused_pointing_at_host_sources() -> None:
    prog = Program("frozen", steps=3)
    s = prog.slice("s")
    total = prog.state("total", slice=s, init=lambda: jnp.zeros((3,)))
    src = prog.source("noise", lambda step, mb: jnp.asarray(np.random.rand(3), jnp.float32), slice=s, per="step")
    prog.node("add", lambda total, x: {"total": total + x}, slice=s, inputs={"total": total, "x": src.ref},
              outputs=("total",), updates={"total": total})
    with pytest.raises(ProgramError, match=r"source 'noise': none of its outputs depends on \(step, microbatch\).*"
                                           r"NumPy's random generator.*host=True"):
        compile_program(prog)


def test_a_job_files_settings_are_the_given_values_then_the_environment_and_every_one_read_is_shipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rallypoint.basics.settings import SETTINGS_FILE, job_config, load_shipped, parse_assignments
    from rallypoint.client.jobfile import load_program

    job = tmp_path / "job.py"
    job.write_text("from rallypoint.client import Program, setting\n"
                   "program = Program(name='t', steps=int(setting('T_STEPS', '3')))\n"
                   "WIDTH = setting('T_WIDTH', '8')\nNONE = setting('T_NONE')\n")
    monkeypatch.setenv("T_WIDTH", "16")
    p = load_program(job, settings=parse_assignments(["T_STEPS=5", "T_EXTRA=a=b"]))
    assert p.steps == 5 and p.settings == {"T_STEPS": "5", "T_WIDTH": "16", "T_EXTRA": "a=b"}
    assert job_config() == p.settings  # this process's settings from now on (a reference run reads the same)
    load_program(job, settings={})
    assert job_config() == {"T_STEPS": "3", "T_WIDTH": "16"}  # a later load starts again
    with pytest.raises(ValueError, match=r"--set 'T_STEPS' is not NAME=VALUE: give e.g. --set LM_D_MODEL=64"):
        parse_assignments(["T_STEPS"])
    (tmp_path / SETTINGS_FILE).write_text('{"A": 1}')
    with pytest.raises(ValueError, match="is not a JSON object of strings"):
        load_shipped(tmp_path)
