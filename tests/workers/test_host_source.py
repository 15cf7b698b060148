"""A host source's process on its own: read ahead in order, checksums kept, a crash is the job's error.

Real child processes (``rallypoint.workers.sources.child``) over a real unpacked bundle
directory; no cluster.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from rallypoint.workers.sources.host import HostSource, SourceError, SourceLedger, instance_order
from rallypoint.workers.residency import Copies
from tests.conftest import wait_until

pytestmark = pytest.mark.processes

SOURCE = '''
import os
import numpy as np

def batches(step, microbatch):
    if step == {crash_at}:
        os._exit(3)  # a loader that dies (a segfault in a C library, an OOM kill)
    return {{"x": np.full((2, 3), step * 10 + microbatch, np.float32), "n": np.int32(step)}}
'''


def source(tmp_path: Path, *, crash_at: int = -1, run_dir: Path | None = None, start: int = 0,
           code: str = "") -> HostSource:
    """The source of SOURCE (crashing at ``crash_at``), or of ``code`` as given, on a bundle under ``tmp_path``."""
    bundle = tmp_path / "bundle"
    bundle.mkdir(exist_ok=True)
    (bundle / "job.py").write_text(code or textwrap.dedent(SOURCE).format(crash_at=crash_at))
    dev = jax.devices()[0]
    whole = jax.sharding.SingleDeviceSharding(dev)
    return HostSource("batch", bundle=bundle, file="job.py", name="batches", outputs=["x", "n"],
                      shardings=[whole, whole], avals=[(np.float32, (2, 3)), (np.int32, ())],
                      order=instance_order(6, start, 1, (0, 1)), ledger=SourceLedger(run_dir, "batch"),
                      prefetch=3, copies=Copies("j"), job="j")


def test_batches_come_in_order_on_the_device_with_their_checksums_kept_and_a_replay_checked(tmp_path: Path) -> None:
    run = tmp_path / "run"
    src = source(tmp_path, run_dir=run)
    try:
        x, n = src(np.int32(2), np.int32(1))  # out of order: read at once
        assert isinstance(x, jax.Array) and float(x[0, 0]) == 21.0 and int(n) == 2
        for step in range(3):
            for mb in range(2):
                if (step, mb) != (2, 1):
                    x, n = src(step, mb)
                    assert float(x[0, 0]) == step * 10 + mb
    finally:
        src.close()
    lines = [json.loads(line) for line in (run / "sources" / "batch.jsonl").read_text().splitlines()]
    assert {(r["s"], r["m"]) for r in lines} >= {(s, m) for s in range(3) for m in range(2)}
    placed = src._copies.bytes("h2d", "source")  # each batch put on the device once, at most 3 read ahead
    assert placed % 28 == 0 and 6 * 28 <= placed <= 9 * 28, placed
    # The same source run again from step 2 (a replay) reads the same bytes: accepted.
    again = source(tmp_path, run_dir=run, start=2)
    try:
        assert float(again(2, 0)[0][0, 0]) == 20.0
    finally:
        again.close()
    # A run directory whose sum for (5, 1) differs (never read above): the source read other bytes there.
    with open(run / "sources" / "batch.jsonl", "a") as f:
        f.write(json.dumps({"s": 5, "m": 1, "h": "0" * 64}) + "\n")
    changed = source(tmp_path, run_dir=run, start=5)
    try:
        with pytest.raises(SourceError, match=r"read different bytes at step 5 microbatch 1 than when it first ran "
                                              r"\(sha256 0000"):
            changed(5, 1)
    finally:
        changed.close()


def test_a_loader_that_dies_fails_its_instance_naming_the_exit_code_and_leaves_no_process(tmp_path: Path) -> None:
    src = source(tmp_path, crash_at=1)
    try:
        assert float(src(0, 0)[0][0, 0]) == 0.0
        with pytest.raises(SourceError, match=r"host source 'batch' \(job.py: batches\): its process \(pid \d+\) "
                                              r"exited with code 3"):
            src(1, 0)
    finally:
        src.close()
    with pytest.raises(ProcessLookupError):
        os.kill(src.pid, 0)


SETTINGS_SOURCE = '''
import os
import numpy as np
from rallypoint.client import setting

SCALE = float(setting("TOY_SCALE", "1"))  # read at import, as examples/lm/train.py reads its sizes

def batches(step, microbatch):
    return {"x": np.full((2, 3), SCALE * step, np.float32), "n": np.int32(os.environ.get("TOY_SCALE", "-1"))}
'''


def test_a_worker_started_without_the_jobs_setting_runs_its_source_with_the_shipped_value(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's bundle ships the settings (`rallypoint run --set`, or the client's environment); the worker's
    code cache unpacks it; the source's process takes them, not the worker's environment (docs/data.md)."""
    from rallypoint.basics.settings import SETTINGS_FILE, encode
    from rallypoint.client.bundle import pack
    from rallypoint.workers.code import CodeCache

    code = tmp_path / "code"
    code.mkdir()
    (code / "job.py").write_text(textwrap.dedent(SETTINGS_SOURCE))
    bundle = pack(code, extra={SETTINGS_FILE: encode({"TOY_SCALE": "7"})})
    run = tmp_path / "run"
    (run / "code").mkdir(parents=True)
    (run / "code" / f"{bundle.sha256}.zip").write_bytes(bundle.zip)
    monkeypatch.setenv("TOY_SCALE", "2")  # the worker's own value: not the job's
    cache = CodeCache(tmp_path / "cache")
    whole = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    src = HostSource("batch", bundle=cache.get(run, bundle.sha256), file="job.py", name="batches",
                     outputs=["x", "n"], shardings=[whole, whole], avals=[(np.float32, (2, 3)), (np.int32, ())],
                     order=instance_order(2, 0, 1, (0,)), ledger=SourceLedger(None, "batch"), prefetch=1,
                     copies=Copies("j"), job="j")
    try:
        x, n = src(1, 0)
        assert float(x[0, 0]) == 7.0 and int(n) == 7
    finally:
        src.close()


CLOSES_FIRST = '''
import os
import time
import numpy as np

def batches(step, microbatch):
    if step == 1:
        os.close(0)  # its input closed first: the worker's next request finds a broken pipe
        open(os.path.join(os.environ["TMPDIR"], "input-closed"), "w").close()  # (the test waits for it)
        time.sleep(0.5)  # then it dies: its exit code is known only after that request
        os._exit(3)
    return {"x": np.full((2, 3), step * 10 + microbatch, np.float32), "n": np.int32(step)}
'''


def test_a_loader_that_closes_its_input_then_dies_is_named_by_its_exit_code_not_as_stopped_answering(
        tmp_path: Path) -> None:
    src = source(tmp_path, code=CLOSES_FIRST)
    try:
        assert float(src(0, 0)[0][0, 0]) == 0.0
        closed = Path(src._tmp) / "input-closed"  # its TMPDIR, the one place it may write
        wait_until(closed.exists, 10, "the source's process to close its input at step 1")
        assert float(src(0, 1)[0][0, 0]) == 1.0  # its next request meets the broken pipe
        with pytest.raises(SourceError, match=r"its process \(pid \d+\) exited with code 3"):
            src(1, 0)
    finally:
        src.close()


ANSWERS_THEN_DIES = '''
import os
import time
import numpy as np

def batches(step, microbatch):
    if (step, microbatch) == (0, 1):
        while not os.path.exists(os.path.join(os.environ["TMPDIR"], "go")):
            time.sleep(0.01)  # the test holds the source's lock first
    if step == 1:
        os.close(0)
        os._exit(3)
    return {"x": np.full((2, 3), step * 10 + microbatch, np.float32), "n": np.int32(step)}
'''


def test_an_answer_written_before_the_loader_died_is_still_given_when_a_later_request_finds_it_dead(
        tmp_path: Path) -> None:
    # The order of CI's failure, made certain: step (0, 1)'s answer is in the pipe but not yet taken by the
    # reader (the test holds the lock the reader needs) when taking (0, 0) asks for (1, 1) and meets a dead
    # process. The answer was written before it died: the slice gets it, and the death only at step 1.
    src = source(tmp_path, code=ANSWERS_THEN_DIES)
    try:
        wait_until(lambda: (0, 0) in src._ready, 20, "step (0, 0) read ahead")
        with src._cv:  # the reader can read (0, 1) but not hand it over
            (Path(src._tmp) / "go").touch()
            wait_until(lambda: src._proc.poll() is not None, 20, "the source's process to die at step 1")
            assert float(src(0, 0)[0][0, 0]) == 0.0  # its top-up asks for (1, 1): a broken pipe
            assert src._dead, "the request for (1, 1) found the process dead"
            assert float(src(0, 1)[0][0, 0]) == 1.0
        with pytest.raises(SourceError, match=r"its process \(pid \d+\) exited with code 3"):
            src(1, 0)
    finally:
        src.close()


CLOSES_AND_HANGS = '''
import os
import time
import numpy as np

def batches(step, microbatch):
    if step == 1:
        os.close(0)
        open(os.path.join(os.environ["TMPDIR"], "input-closed"), "w").close()
        time.sleep(600)  # and never answers, nor exits
    return {"x": np.full((2, 3), step * 10 + microbatch, np.float32), "n": np.int32(step)}
'''


def test_a_loader_that_closes_its_input_and_hangs_is_stopped_and_named_as_stopped_answering(
        tmp_path: Path) -> None:
    src = source(tmp_path, code=CLOSES_AND_HANGS)
    try:
        wait_until((Path(src._tmp) / "input-closed").exists, 20, "the source's process to close its input")
        assert float(src(0, 0)[0][0, 0]) == 0.0  # its top-up asks for (1, 1): a broken pipe
        assert float(src(0, 1)[0][0, 0]) == 1.0  # written before: still given
        with pytest.raises(SourceError, match=r"its process \(pid \d+\) stopped answering"):
            src(1, 0)  # asked before it closed its input: no answer can come, and the wait ends
        assert src._proc.poll() is not None, "the process that can be asked nothing more was stopped"
    finally:
        src.close()


DIES_LEAVING_A_CHILD = '''
import os
import time
import numpy as np

def batches(step, microbatch):
    if step == 1:
        os.close(0)
        if os.fork() == 0:  # a loader's worker process, holding the source's output open after it died
            with open(os.path.join(os.environ["TMPDIR"], "holder.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.rename(os.path.join(os.environ["TMPDIR"], "holder.tmp"),
                      os.path.join(os.environ["TMPDIR"], "holder.pid"))  # whole, once it is there
            time.sleep(600)
            os._exit(0)
        while not os.path.exists(os.path.join(os.environ["TMPDIR"], "holder.pid")):
            time.sleep(0.01)
        os._exit(3)
    return {"x": np.full((2, 3), step * 10 + microbatch, np.float32), "n": np.int32(step)}
'''


def test_a_loader_that_dies_leaving_a_process_that_holds_its_output_fails_the_step_instead_of_waiting_forever(
        tmp_path: Path) -> None:
    src = source(tmp_path, code=DIES_LEAVING_A_CHILD)
    holder = Path(src._tmp) / "holder.pid"
    try:
        assert float(src(0, 0)[0][0, 0]) == 0.0
        assert float(src(0, 1)[0][0, 0]) == 1.0
        wait_until(holder.exists, 20, "the source's process to start the one that outlives it")
        with pytest.raises(SourceError, match=r"its process \(pid \d+\) exited with code 3"):
            src(1, 0)  # no answer comes (the pipe stays open): the wait for one ends
        assert src._reader.is_alive(), "the output was still held open: the bound ended the wait, not its end"
    finally:
        pid = int(holder.read_text()) if holder.exists() else 0
        src.close()  # does not wait on the held pipe either
        if pid:
            os.kill(pid, 9)
