"""Checkpoints are never lost by bookkeeping: writers of one slice keep to their own directories,
retention deletes only what no live commit names, a zombie deletes nothing, a restore reads only
inside the slice's directory, and commits retry on the injected clock. Real Orbax on tmp dirs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from rallypoint.basics.clock import FakeClock
from rallypoint.basics.errors import StoreUnavailable
from rallypoint.basics.logs import configure
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.store import created_at
from rallypoint.orchestrator.job.state import JobFailed
from rallypoint.orchestrator.job.runs import run_dir
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.etcd.commits import CheckpointCommit, read_worker_commits
from rallypoint.workers.checkpoints.checkpointer import SliceCheckpointer
from rallypoint.workers.checkpoints.committer import COMMIT_RETRY_S, etcd_commit
from rallypoint.workers.checkpoints.restore import latest_committed, restore_commit
from rallypoint.workers.runtime.checkpoints import restore_for_load
from rallypoint.workers.errors import CheckpointCorrupt, CommitRefused, RestoreError
from tests.fakes import MemoryStore, register_worker
from tests.helpers.checkpoints import Recorder, assert_bitwise, register, states_at


def writer(slice_dir: Path, commit: Any, *, max_to_keep: int | None = 1) -> SliceCheckpointer:
    """A checkpointer whose retention forgets commits through ``commit`` as a worker's does."""
    forget = getattr(commit, "forget", None)
    return SliceCheckpointer(slice_dir, job="j", slice_name="s0", max_to_keep=max_to_keep, commit=commit,
                             forget=(lambda s, p: forget("j", "s0", s, p)) if forget else None)


def test_two_writers_of_one_slice_one_fenced_never_touch_each_others_checkpoints(
        store: EtcdStore, tmp_path: Path) -> None:
    keys = Keys("writers")
    slice_dir = tmp_path / "run" / "s0"
    inc = register(store, keys, "w1")
    zombie = writer(slice_dir, etcd_commit(store, keys, created_at(keys.worker("w1"), inc)))
    live: SliceCheckpointer | None = None
    try:
        zombie.protect(10)  # the cut the next incarnation restores
        for step in (10, 20):
            zombie.save(step, states_at(step))
        zombie.wait()
        old = {c.step: c for c in read_worker_commits(store, keys, "w1", "j")["s0"]}
        assert sorted(old) == [10, 20]
        marker = Path(old[20].path) / "marker"
        marker.write_text("the directory the commit of step 20 names")

        store.delete(keys.worker("w1"))  # the worker re-registers: the first incarnation is a zombie
        new_inc = register(store, keys, "w1")
        zombie.save(30, {"w": [np.random.default_rng(3).integers(0, 256, 128 << 20, dtype=np.uint8)]})
        assert zombie.pending_steps == [30]  # Orbax still writing it

        # The next incarnation's checkpointer starts on the same slice directory while the zombie's save is in
        # flight (Orbax cleans temporary directories up as it starts), then replays step 20, which counts already.
        live = writer(slice_dir, etcd_commit(store, keys, created_at(keys.worker("w1"), new_inc)))
        live.protect(10)
        live.save(20, states_at(20))
        live.wait()
        assert marker.exists(), "the replay rewrote the committed step in place"
        now = {c.step: c for c in read_worker_commits(store, keys, "w1", "j")["s0"]}
        assert now[20].path == str(live.directory / "20") != old[20].path
        assert_bitwise(restore_commit(now[20], slice_dir), states_at(20))

        # The zombie's save finished in its own directory (nobody deleted it) and does not count.
        with pytest.raises(CommitRefused):
            zombie.wait()
        assert 30 in zombie.steps_on_disk()
        assert 30 not in {c.step for c in read_worker_commits(store, keys, "w1", "j")["s0"]}

        # The zombie's retention may not delete what a live commit names (step 10, the cut).
        zombie.release(10)  # step 10 is now older than the zombie's newest commit and no longer protected by it
        assert_bitwise(restore_commit(old[10], slice_dir), states_at(10))

        # The live writer's retention: its own step 20 goes with its commit, the orphaned directory of the
        # zombie's step 20 goes too; the cut (protected) stays, in the zombie's directory, where its commit points.
        live.save(30, states_at(30))
        live.wait()
        final = {c.step: c for c in read_worker_commits(store, keys, "w1", "j")["s0"]}
        assert sorted(final) == [10, 30]
        assert final[10].path == old[10].path and final[30].path == str(live.directory / "30")
        assert not Path(old[20].path).exists() and not (live.directory / "20").exists()
        for c in final.values():
            assert_bitwise(restore_commit(c, slice_dir), states_at(c.step))
    finally:
        zombie.close()
        if live is not None:
            live.close()


def test_forget_deletes_only_the_commit_naming_the_directory_and_refuses_when_fenced() -> None:
    store, keys = MemoryStore(), Keys("t")
    inc = register_worker(store, keys, "w1", 1)
    committer = etcd_commit(store, keys, created_at(keys.worker("w1"), inc))
    committer(CheckpointCommit("j", "s0", 5, "/ck/s0/w-b/5", "sha256:x"))
    committer.forget("j", "s0", 5, "/ck/s0/w-a/5")  # another writer's commit of step 5: it stays
    assert [c.path for c in read_worker_commits(store, keys, "w1", "j")["s0"]] == ["/ck/s0/w-b/5"]
    committer.forget("j", "s0", 5, "/ck/s0/w-b/./5")
    assert read_worker_commits(store, keys, "w1", "j") == {}
    committer.forget("j", "s0", 5, "/ck/s0/w-b/5")  # nothing left to forget

    committer(CheckpointCommit("j", "s0", 6, "/ck/s0/w-b/6", "sha256:x"))
    store.delete(keys.worker("w1"))
    register_worker(store, keys, "w1", 1)
    with pytest.raises(CommitRefused):
        committer.forget("j", "s0", 6, "/ck/s0/w-b/6")
    assert [c.step for c in read_worker_commits(store, keys, "w1", "j")["s0"]] == [6]


class Unreachable(MemoryStore):
    """etcd down for the first ``down`` transactions."""

    def __init__(self, down: int) -> None:
        super().__init__()
        self.down, self.calls = down, 0

    def txn(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.down:
            raise StoreUnavailable("etcd is down (test)")
        return super().txn(*args, **kwargs)


def test_commits_retry_an_unreachable_etcd_on_the_injected_clock() -> None:
    keys, c = Keys("t"), CheckpointCommit("j", "s0", 5, "/ck/s0/w-a/5", "sha256:x")
    store = Unreachable(down=5)
    inc = register_worker(store, keys, "w1", 1)
    clock = FakeClock()
    t0, start = time.monotonic(), clock.monotonic()
    etcd_commit(store, keys, created_at(keys.worker("w1"), inc), clock=clock)(c)
    assert [x.step for x in read_worker_commits(store, keys, "w1", "j")["s0"]] == [5]
    assert store.calls == 6 and clock.monotonic() > start

    store.down = 10**9  # never comes back: the commit gives up after COMMIT_RETRY_S of the clock, not of the wall
    start = clock.monotonic()
    with pytest.raises(StoreUnavailable):
        etcd_commit(store, keys, created_at(keys.worker("w1"), inc), clock=clock)(c)
    assert clock.monotonic() - start >= COMMIT_RETRY_S
    assert time.monotonic() - t0 < 5


def test_a_commit_path_outside_the_slice_directory_is_refused_unread(tmp_path: Path) -> None:
    rec = Recorder()
    elsewhere = SliceCheckpointer(tmp_path / "elsewhere" / "s0", job="j", slice_name="s0", max_to_keep=None,
                                  commit=rec)
    inside = SliceCheckpointer(tmp_path / "run" / "s0", job="j", slice_name="s0", max_to_keep=None, commit=rec)
    try:
        inside.save(10, states_at(10))
        inside.wait()
        elsewhere.save(20, states_at(20))
        elsewhere.wait()
    finally:
        inside.close()
        elsewhere.close()
    good, outside = rec.commits  # both valid checkpoints: only where they lie differs
    # A worker loaded to restore a commit whose path lies outside the run's directory of the slice.
    req = pb.LoadJobRequest(job="j", start_step=20, checkpoint_dir=str(tmp_path / "run"),
                            slices=[pb.SliceAssignment(slice="s0")], states=[pb.StateProgram(name="p", slice="s0")],
                            restore=[pb.CheckpointRef(slice="s0", step=20, path=outside.path, checksum=outside.checksum)])
    with pytest.raises(RestoreError, match="outside"):
        restore_for_load(req)
    req.restore[0].CopyFrom(pb.CheckpointRef(slice="s0", step=10, path=good.path, checksum=good.checksum))
    assert_bitwise(restore_for_load(req)["s0"], states_at(10))
    slice_dir = tmp_path / "run" / "s0"
    (slice_dir / "link").symlink_to(elsewhere.directory)
    bad = [
        ("outside", outside),
        ("'..'", CheckpointCommit("j", "s0", 20, f"{slice_dir}/../../elsewhere/s0/{elsewhere.directory.name}/20",
                                  outside.checksum)),
        ("outside", CheckpointCommit("j", "s0", 20, str(slice_dir / "link" / "20"), outside.checksum)),  # a symlink
        ("not absolute", CheckpointCommit("j", "s0", 20, f"s0/{elsewhere.directory.name}/20", outside.checksum)),
        ("invalid slice name", CheckpointCommit("j", "../s0", 20, outside.path, outside.checksum)),
    ]
    configure()
    for why, c in bad:
        with capture_logs() as logs, pytest.raises(CheckpointCorrupt, match=why):
            restore_commit(c, slice_dir)
        assert [e["event"] for e in logs] == ["checkpoint.path_refused"], why  # refused before any read

    found = latest_committed([good, outside], slice_dir)  # the newer one escapes: fall back to the older
    assert found.commit == good and [c.step for c, _ in found.skipped] == [20]


def test_latest_must_name_a_run_directory_of_the_job(tmp_path: Path) -> None:
    run = run_dir(tmp_path, "pipe", create=True)
    assert run_dir(tmp_path, "pipe", create=False) == run
    (tmp_path / "elsewhere").mkdir()
    for name in ("../elsewhere", str(tmp_path / "elsewhere"), "run-20261204T000000-abcdef/../../elsewhere"):
        (tmp_path / "pipe" / "LATEST").write_text(name + "\n")
        with pytest.raises(JobFailed, match="not a run id|not a run directory|outside|symlink"):
            run_dir(tmp_path, "pipe", create=False)
    (tmp_path / "pipe" / "run-20261204T000000-abcdef").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "pipe" / "LATEST").write_text("run-20261204T000000-abcdef\n")
    with pytest.raises(JobFailed, match="not a run id|not a run directory|outside|symlink"):
        run_dir(tmp_path, "pipe", create=False)
