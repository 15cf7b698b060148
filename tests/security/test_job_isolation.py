"""Submitted code against the worker that runs it (docs/security.md, "Submitted code"): a host source's real
process, started as a worker starts it, tries to read the worker's key, see its environment, reach into the
worker's process, and rewrite a job's unpacked code; one that sends an impossible array or raises MemoryError
fails its job, never hangs it. The embedded cluster points no daemon at the CA's key or another's key.
"""

from __future__ import annotations

import os
import textwrap
import threading
import zipfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from rallypoint.basics.tls import forget
from rallypoint.cluster import local_security as security
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig
from rallypoint.workers.code import CodeCache
from rallypoint.workers.sources import landlock
from rallypoint.workers.sources.host import HostSource, SourceError, SourceLedger, instance_order
from rallypoint.workers.sources.sandbox import SourcePolicy

pytestmark = pytest.mark.processes

PROBE = '''
import os
import numpy as np

def _can(f):
    try:
        f()
        return 1
    except OSError:
        return 0

def _write(path):
    with open(path, "w") as fh:
        fh.write("pwned")

def probe(step, microbatch):
    key, other = os.environ.get("PROBE_KEY", "{key}"), "{other}"
    return {{"x": np.array([
        _can(lambda: open("{key}", "rb").read()),  # the worker's own key
        _can(lambda: open("/proc/%d/root{key}" % os.getppid(), "rb").read()),  # the same through /proc
        _can(lambda: open("/proc/%d/environ" % os.getppid(), "rb").read()),  # the worker's environment
        int(any("TLS" in k or "ETCD" in k or "SECRET" in k for k in os.environ)),  # its own environment
        _can(lambda: _write(os.path.join(os.path.dirname(__file__), "job.py"))),  # its own unpacked code
        _can(lambda: _write(other)),  # another job's unpacked code
        _can(lambda: _write(os.path.join(os.environ["TMPDIR"], "scratch"))),  # its own TMPDIR: allowed
    ], np.int32)}}
'''


def bundle_zip(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def unpacked(tmp_path: Path, cache: CodeCache, name: str, files: dict[str, str]) -> Path:
    import hashlib

    run = tmp_path / f"run-{name}"
    data = bundle_zip(tmp_path / f"{name}.zip", files).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    (run / "code").mkdir(parents=True)
    (run / "code" / f"{sha}.zip").write_bytes(data)
    return cache.get(run, sha)


def host_source(bundle: Path, fn: str, avals: list[tuple[Any, tuple[int, ...]]], policy: SourcePolicy | None = None,
                **kw: Any) -> HostSource:
    whole = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return HostSource("probe", bundle=bundle, file="job.py", name=fn, outputs=["x"], shardings=[whole] * len(avals),
                      avals=avals, order=instance_order(2, 0, 1, (0,)), ledger=SourceLedger(None, "probe"),
                      prefetch=1, job="j", **({"policy": policy} if policy is not None else {}), **kw)


@pytest.mark.skipif(landlock.abi() < 1, reason="this kernel has no Landlock: a source runs unsandboxed here "
                                               "(docs/security.md says what holds then)")
def test_a_host_source_cannot_read_the_workers_key_nor_its_environment_nor_write_any_jobs_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tls = tmp_path / "tls"
    tls.mkdir(mode=0o700)
    key = tls / "w0.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    key.chmod(0o600)
    monkeypatch.setenv("RALLYPOINT_TLS_DIR", str(tls))  # what a daemon started with --tls-dir's envvar has
    monkeypatch.setenv("ETCD_ENDPOINTS", "https://127.0.0.1:2379")
    monkeypatch.setenv("MY_SECRET_TOKEN", "hunter2")
    cache = CodeCache(tmp_path / "cache")
    other = unpacked(tmp_path, cache, "other", {"job.py": "x = 1\n"})
    mine = unpacked(tmp_path, cache, "mine", {"job.py": textwrap.dedent(PROBE).format(key=key,
                                                                                    other=other / "job.py")})
    src = host_source(mine, "probe", [(np.int32, (7,))], SourcePolicy(hide=(str(tls),)))
    try:
        (x,) = src(0, 0)
    finally:
        src.close()
    got = dict(zip(["key", "key via /proc", "worker environ", "env names", "own code", "other code", "tmpdir"],
                   np.asarray(x).tolist()))
    assert got == {"key": 0, "key via /proc": 0, "worker environ": 0, "env names": 0, "own code": 0,
                   "other code": 0, "tmpdir": 1}, got
    assert (other / "job.py").read_text() == "x = 1\n"


FORGED = '''
import gc, io, json
import numpy as np

def forged(step, microbatch):
    """Writes a header of its own on the protocol stream: an array of 4 TiB."""
    out = next(o for o in gc.get_objects() if isinstance(o, io.BufferedWriter) and not o.closed
               and isinstance(o.raw.name, int) and o.raw.name > 2)
    out.write((json.dumps({"s": step, "m": microbatch, "leaves": [["<f4", [1 << 40]]], "sum": "0"}) + "\\n").encode())
    out.flush()
    return {"x": np.zeros((4,), np.float32)}

def starved(step, microbatch):
    raise MemoryError("the loader ran out of memory")
'''


def answer(src: HostSource, timeout_s: float = 30.0) -> BaseException | None:
    """What ``src(0, 0)`` raises, waiting at most ``timeout_s``: a hang fails the test instead of the suite."""
    got: dict[str, BaseException | None] = {}

    def call() -> None:
        try:
            src(0, 0)
            got["exc"] = None
        except BaseException as exc:  # noqa: BLE001
            got["exc"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"the source's step still waits after {timeout_s:.0f}s: the job hangs"
    return got["exc"]


def test_a_source_announcing_an_array_past_its_declared_shape_fails_its_job_naming_the_step(tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "job.py").write_text(textwrap.dedent(FORGED))
    src = host_source(bundle, "forged", [(np.float32, (4,))])
    try:
        exc = answer(src)
    finally:
        src.close()
    assert isinstance(exc, SourceError), exc
    assert "host source 'probe'" in str(exc) and "step 0" in str(exc) and "1099511627776" in str(exc), exc


def test_a_source_that_raises_memory_error_fails_its_job_with_the_error(tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "job.py").write_text(textwrap.dedent(FORGED))
    src = host_source(bundle, "starved", [(np.float32, (4,))])
    try:
        exc = answer(src)
    finally:
        src.close()
    assert isinstance(exc, SourceError) and "raised at step 0" in str(exc) and "MemoryError" in str(exc), exc


def test_the_embedded_clusters_daemons_see_ca_crt_and_their_own_pair_only(tmp_path: Path) -> None:
    state = tmp_path / "state"
    security.issue_etcd_and_client(state, host="127.0.0.1", cluster="t")
    tls = security.cluster_tls_dir(state)
    for name, role in (("c0", "coordinator"), ("w0", "worker")):
        security.issue_process(tls, name, role=role, host="127.0.0.1", cluster="t", net=None)
    endpoints = ["127.0.0.1:1"]
    lc = LocalCluster(LocalClusterConfig(state_dir=state, cluster="t"), endpoints, [])
    try:
        for name, role in (("c0", "coordinator"), ("w0", "worker")):
            argv = lc.argv(role, name)
            own = Path(argv[argv.index("--tls-dir") + 1])
            assert sorted(os.listdir(own)) == sorted(["ca.crt", f"{name}.crt", f"{name}.key"]), own
            assert own != tls and (own.stat().st_mode & 0o077) == 0
        argv = lc.argv("worker", "w0")
    finally:
        forget(endpoints)  # the identity the cluster recorded for its endpoints: no other test may use it
    assert not (tls / "w0.key").exists() and not (tls / "c0.key").exists()  # beside ca.key: no daemon's key
    hidden = [argv[i + 1] for i, a in enumerate(argv) if a == "--source-hide"]
    assert str(tls) in hidden  # ca.key, the operator's and every other key: hidden from the job code it runs


def test_a_writable_folder_holding_the_code_cache_or_a_hidden_folder_is_not_granted(tmp_path: Path) -> None:
    """Landlock's rights only add up: a folder a source may write that holds the code cache (or the keys) would
    make them writable (readable): such a folder is left out, never granted."""
    (tmp_path / "home" / ".cache" / "code").mkdir(parents=True)
    (tmp_path / "home" / "tls").mkdir()
    (tmp_path / "tmp").mkdir()
    rules = dict(landlock.plan(hide=[tmp_path / "home" / "tls"],
                               write=[tmp_path / "home" / ".cache", tmp_path / "home", tmp_path / "tmp"],
                               read_only=[tmp_path / "home" / ".cache" / "code"]))
    real = tmp_path.resolve()
    assert rules.get(real / "tmp") == -1
    assert real / "home" not in rules or rules[real / "home"] == landlock.READ_DIR
    assert real / "home" / ".cache" not in rules or rules[real / "home" / ".cache"] != -1
    assert real / "home" / "tls" not in rules
