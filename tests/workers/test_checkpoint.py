"""Tests for workers.checkpoint: real Orbax on tmp dirs, real etcd for the commits, a real SIGKILL."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest
from structlog.testing import capture_logs

from rallypoint.etcd.keys import Keys
from rallypoint.basics.logs import configure
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.store import created_at
from tests.conftest import wait_until
from rallypoint.etcd.commits import CheckpointCommit, consistent_cut, read_worker_commits
from rallypoint.workers.checkpoints.checkpointer import SliceCheckpointer
from rallypoint.workers.checkpoints.checksums import binding, state_checksum
from rallypoint.workers.checkpoints.committer import etcd_commit
from rallypoint.workers.checkpoints.restore import latest_committed, restore_commit
from rallypoint.workers.errors import CheckpointCorrupt, CheckpointError, CommitRefused
from tests.helpers.checkpoints import Recorder, assert_bitwise, largest_file, register, states_at

REPO = Path(__file__).resolve().parents[2]
KILL_MB = 256  # large enough that Orbax takes about a second to write it


@contextmanager
def captured_events() -> Iterator[list[Any]]:
    """Log events of loggers made inside the block (configured first, so get_logger keeps the capture)."""
    configure()
    with capture_logs() as logs:
        yield logs


def make(directory: Path, commit: Any, max_to_keep: int | None = None, slice_name: str = "s0") -> SliceCheckpointer:
    return SliceCheckpointer(directory, job="j", slice_name=slice_name, max_to_keep=max_to_keep, commit=commit)


def test_round_trip_is_bitwise_and_commit_names_the_checkpoint(tmp_path: Path) -> None:
    rec = Recorder()
    with captured_events() as logs:
        ck = make(tmp_path / "j" / "s0", rec)
        try:
            ck.save(10, states_at(10))
            ck.wait()
            got = ck.restore(10, rec.commits[0].checksum)
        finally:
            ck.close()
    assert_bitwise(got, states_at(10))
    c = rec.commits[0]
    assert ck.directory.parent == (tmp_path / "j" / "s0").absolute()  # the slice's directory, then the writer's
    assert c == CheckpointCommit("j", "s0", 10, str(ck.directory / "10"),
                                 state_checksum(states_at(10), binding("j", "j", "s0", 10)),
                                 ("stage0.opt", "stage0.params"))
    assert re.fullmatch(r"sha256b:[0-9a-f]{64}", c.checksum)  # bound to job, run, slice and step
    assert CheckpointCommit.from_json(json.loads(json.dumps(c.to_json()))) == c
    assert state_checksum(states_at(11), binding("j", "j", "s0", 10)) != c.checksum
    events = [e["event"] for e in logs if e["event"].startswith("checkpoint.")]
    assert events.index("checkpoint.saved") < events.index("checkpoint.committed")
    assert all(e["job"] == "j" and e["slice"] == "s0" for e in logs if e["event"] == "checkpoint.committed")


def test_save_returns_before_orbax_finalizes_and_commit_follows(tmp_path: Path) -> None:
    rec = Recorder()
    d = tmp_path / "s0"
    big = {"w": [np.random.default_rng(0).integers(0, 256, 128 << 20, dtype=np.uint8)]}
    ck = make(d, rec)
    try:
        ck.save(1, big)
        # Orbax is still writing: not finalized, not committed.
        assert ck.pending_steps == [1] and rec.commits == []
        assert 1 not in ocp.path.step.checkpoint_steps(ck.directory)
        ck.wait()
        assert rec.steps == [1] and ck.pending_steps == []
        assert ocp.path.step.checkpoint_steps(ck.directory) == [1]
    finally:
        ck.close()


def test_commits_happen_in_step_order_after_the_caller_moves_on(tmp_path: Path) -> None:
    rec = Recorder()
    rec.gate.clear()  # etcd is slow: commits queue up behind the first
    ck = make(tmp_path / "s0", rec)
    try:
        for step in (5, 10, 15):
            ck.save(step, states_at(step))
        with pytest.raises(CheckpointError, match="still pending"):
            ck.wait(timeout_s=0.3)
        assert rec.commits == []
        rec.gate.set()
        ck.wait()
        assert rec.steps == [5, 10, 15]
        assert [c.step for c in ck.commits] == [5, 10, 15]
        with pytest.raises(CheckpointError, match="must increase"):
            ck.save(15, states_at(15))
        with pytest.raises(CheckpointError, match="zero size"):  # Orbax refuses it; the next save still works
            ck.save(20, {"empty": [np.zeros((0, 3), np.float32)]})
        ck.save(20, states_at(20))
        ck.wait()
        assert rec.steps == [5, 10, 15, 20]
    finally:
        ck.close()


def test_corrupt_newest_checkpoint_is_detected_and_an_older_commit_is_used(tmp_path: Path) -> None:
    rec = Recorder()
    ck = make(tmp_path / "s0", rec)
    d = ck.directory
    try:
        for step in (10, 20, 30):
            ck.save(step, states_at(step, n=100_000))
        ck.wait()
        # Flip bytes in the middle of step 20's data: Orbax restores it without complaint.
        f = largest_file(d / "20")
        data = bytearray(f.read_bytes())
        data[len(data) // 2: len(data) // 2 + 64] = b"\x5a" * 64
        f.write_bytes(bytes(data))
        silently_wrong = ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(read_only=True))
        try:
            raw = silently_wrong.restore(20, args=ocp.args.StandardRestore())
        finally:
            silently_wrong.close()
        assert state_checksum(raw) != rec.commits[1].checksum
        # Step 30 is gone altogether.
        shutil.rmtree(d / "30")

        with captured_events() as logs, pytest.raises(CheckpointCorrupt) as info:
            ck.restore(20, rec.commits[1].checksum)
        msg = str(info.value)
        for part in ("'j'", "'s0'", "step 20", str(d.absolute() / "20"), rec.commits[1].checksum,
                     state_checksum(raw, binding("j", d.parent.parent.name, "s0", 20))):
            assert part in msg
        assert [e["event"] for e in logs] == ["checkpoint.corrupt"]

        with captured_events() as logs:
            found = latest_committed(rec.commits)
        assert found.commit == rec.commits[0]
        assert found.states is not None
        assert_bitwise(found.states, states_at(10, n=100_000))
        assert [(c.step, "unreadable" in why) for c, why in found.skipped] == [(30, True), (20, False)]
        assert [(e["event"], e["step"]) for e in logs] == [("checkpoint.corrupt", 30), ("checkpoint.corrupt", 20)]
    finally:
        ck.close()


def test_retention_keeps_the_newest_commits_and_protected_steps(tmp_path: Path) -> None:
    rec = Recorder(fail_at={6})
    ck = make(tmp_path / "s0", rec, max_to_keep=2)
    try:
        ck.protect(1)
        for step in range(1, 6):
            ck.save(step, states_at(step))
        ck.wait()
        assert ck.steps_on_disk() == [1, 4, 5]
        ck.release(1)
        assert ck.steps_on_disk() == [4, 5]
        with pytest.raises(CheckpointError, match="not protected"):
            ck.release(1)
        # A checkpoint that does not count yet never costs an older one that does.
        ck.save(6, states_at(6))
        with pytest.raises(RuntimeError, match="step 6 failed"):
            ck.wait()
        assert ck.steps_on_disk() == [4, 5, 6]
        ck.protect(4)
        ck.protect(4)
        for step in (7, 8):
            ck.save(step, states_at(step))
        ck.wait()
        assert ck.steps_on_disk() == [4, 7, 8]
        ck.release(4)
        assert ck.steps_on_disk() == [4, 7, 8]
        ck.release(4)
        assert ck.steps_on_disk() == [7, 8]
        assert_bitwise(ck.restore(7, rec.commits[-2].checksum), states_at(7))
    finally:
        ck.close()
    keep_all = make(tmp_path / "s1", Recorder(), max_to_keep=None)
    try:
        for step in range(4):
            keep_all.save(step, states_at(step))
        keep_all.wait()
        assert keep_all.steps_on_disk() == [0, 1, 2, 3]
    finally:
        keep_all.close()


def _save_then_hang(directory: str, commits_file: str, saving_file: str) -> None:
    """Child process: commit step 1, then start saving a large step 2 and wait to be killed."""

    def commit(c: CheckpointCommit) -> None:
        with open(commits_file, "a") as f:
            f.write(json.dumps(c.to_json()) + "\n")
            f.flush()
            os.fsync(f.fileno())

    ck = SliceCheckpointer(Path(directory), job="j", slice_name="s0", max_to_keep=1, commit=commit)
    ck.save(1, states_at(1))
    ck.wait()
    big = np.random.default_rng(2).integers(0, 256, KILL_MB << 20, dtype=np.uint8)
    ck.save(2, {"w": [big]})
    Path(saving_file).write_text("saving")
    time.sleep(120)


@pytest.mark.processes
def test_a_worker_killed_mid_save_leaves_the_previous_commit_in_force(tmp_path: Path) -> None:
    d, commits_file, saving = tmp_path / "s0", tmp_path / "commits.jsonl", tmp_path / "saving"
    child = multiprocessing.get_context("spawn").Process(
        target=_save_then_hang, args=(str(d), str(commits_file), str(saving)), daemon=True)
    child.start()
    assert child.pid is not None
    try:
        wait_until(lambda: saving.exists() or not child.is_alive(), 60, "the child to start saving step 2",
                   interval_s=0.005)
        assert child.is_alive(), f"child exited with {child.exitcode}"
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
            child.join(10)

    commits = [CheckpointCommit.from_json(json.loads(line)) for line in commits_file.read_text().splitlines()]
    assert [c.step for c in commits] == [1]
    (dead,) = d.iterdir()  # the killed writer's directory
    # The save was cut off mid-write, and Orbax does not count it as a step.
    assert [p.name for p in dead.iterdir() if p.name.startswith("2")] == ["2.orbax-checkpoint-tmp"]
    assert ocp.path.step.checkpoint_steps(dead) == [1]
    plain = ocp.CheckpointManager(dead, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        assert list(plain.all_steps()) == [1]
    finally:
        plain.close()

    rec = Recorder()
    ck = make(d, rec, max_to_keep=1)  # the next incarnation, on the same directory
    try:
        ck.protect(1)  # as a recovery does while it restores
        assert_bitwise(restore_commit(commits[0], d), states_at(1))
        found = latest_committed(commits, d)
        assert found.commit == commits[0] and found.skipped == []
        ck.save(2, states_at(2))
        ck.wait()
        assert rec.steps == [2] and ck.steps_on_disk() == [2]
        assert ocp.path.step.checkpoint_steps(dead) == [1]
        ck.release(1)  # committed by another life: retention counts it once released
        assert ck.steps_on_disk() == [2] and ocp.path.step.checkpoint_steps(dead) == []
        # The new writer's Orbax never cleans another writer's directory: a writer's save in flight is its own.
        assert [p.name for p in dead.iterdir()] == ["2.orbax-checkpoint-tmp"]
    finally:
        ck.close()


def test_consistent_cut_is_the_newest_step_every_slice_committed() -> None:
    def commits(slice_name: str, *steps: int) -> list[CheckpointCommit]:
        return [CheckpointCommit("j", slice_name, s, f"/c/{slice_name}/{s}", "sha256:x") for s in steps]

    by_slice = {"a": commits("a", 10, 20, 30), "b": commits("b", 10, 20), "c": commits("c", 10, 30)}
    assert consistent_cut(by_slice, ["a", "b"]) == 20
    assert consistent_cut(by_slice, ["a", "c"]) == 30
    assert consistent_cut(by_slice, ["a", "b", "c"]) == 10
    assert consistent_cut(by_slice, ["a", "b"], before=20) == 10
    assert consistent_cut(by_slice, ["a", "b"], before=10) is None
    assert consistent_cut(by_slice, ["a", "d"]) is None
    assert consistent_cut(by_slice, []) is None


def test_checkpoint_keys_sort_by_step_under_the_job() -> None:
    k = Keys("t")
    assert k.checkpoint("j", "s0", 20) == "/rallypoint/t/jobs/j/checkpoints/s0/000000000020"
    assert k.checkpoint("j", "s0", 20).startswith(k.checkpoints("j"))
    assert k.checkpoints("j").startswith(k.job("j") + "/")
    assert not k.checkpoint("j10", "s0", 1).startswith(k.checkpoints("j1"))
    steps = [9, 10, 100, 2, 1_000_000]
    assert sorted(k.checkpoint("j", "s0", s) for s in steps) == [k.checkpoint("j", "s0", s) for s in sorted(steps)]


def test_commits_in_etcd_are_guarded_on_the_incarnation(store: EtcdStore, tmp_path: Path) -> None:
    keys = Keys("t")
    inc = register(store, keys, "w1")
    guard = created_at(keys.worker("w1"), inc)
    a = make(tmp_path / "s0", etcd_commit(store, keys, guard), slice_name="s0")
    b = make(tmp_path / "s1", etcd_commit(store, keys, guard), slice_name="s1")
    try:
        for step in (10, 20):
            a.save(step, states_at(step))
        b.save(10, states_at(10))
        a.wait()
        b.wait()
        commits = read_worker_commits(store, keys, "w1", "j")
        assert {s: [c.step for c in cs] for s, cs in commits.items()} == {"s0": [10, 20], "s1": [10]}
        assert commits["s0"] == a.commits and commits["s1"] == b.commits
        assert consistent_cut(commits, ["s0", "s1"]) == 10
        kv = store.get(keys.worker_commit("w1", "j", "s0", 20))  # its own key: the leader promotes it
        assert kv is not None
        raw = kv.json()
        assert (raw["worker"], raw["incarnation"], raw["slice"]) == ("w1", inc, "s0")

        # The worker re-registers: the old incarnation is a zombie and cannot commit.
        store.delete(keys.worker("w1"))
        new_inc = register(store, keys, "w1")
        a.save(30, states_at(30))
        with pytest.raises(CommitRefused, match=f"incarnation {inc} is fenced"):
            a.wait()
        assert [c.step for c in read_worker_commits(store, keys, "w1", "j")["s0"]] == [10, 20]
        assert 30 in a.steps_on_disk()  # finalized by Orbax, but it does not count

        fresh = etcd_commit(store, keys, created_at(keys.worker("w1"), new_inc))
        b.close()
        b2 = make(tmp_path / "s1", fresh, slice_name="s1")
        try:
            b2.save(20, states_at(20))
            b2.wait()
        finally:
            b2.close()
        commits = read_worker_commits(store, keys, "w1", "j")
        assert consistent_cut(commits, ["s0", "s1"]) == 20
        assert latest_committed(commits["s1"]).commit == commits["s1"][-1]
    finally:
        a.close()
        b.close()


def doc_snippet() -> str:
    """The first Python block of docs/checkpoints.md's "Orbax alone" section."""
    text = (REPO / "docs" / "checkpoints.md").read_text()
    section = text.split("## Loading a slice's state with Orbax alone", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)  # type: ignore[union-attr]


def test_orbax_alone_loads_a_slice_as_the_docs_show(tmp_path: Path) -> None:
    rec = Recorder()
    d = tmp_path / "j" / "s0"
    ck = make(d, rec)
    try:
        for step in (10, 20):
            ck.save(step, states_at(step))
        ck.wait()
    finally:
        ck.close()

    code = doc_snippet()
    imports = [line for line in code.splitlines() if line.startswith(("import ", "from "))]
    assert imports == ["import orbax.checkpoint as ocp"]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/checkpoints.md", "exec"), namespace)  # noqa: S102 - the documented code, verbatim
    assert rec.commits[1].path == str(ck.directory / "20")
    state = namespace["load_slice_state"](str(Path(rec.commits[1].path).parent), 20)
    assert_bitwise(state, states_at(20))
    assert state_checksum(state, binding("j", "j", "s0", 20)) == rec.commits[1].checksum


def test_the_slices_of_one_worker_save_at_the_same_time_and_every_commit_arrives(tmp_path: Path) -> None:
    # A worker holding several slices runs one checkpointer each, saving from their own threads. Orbax keys a save's
    # signals by a process-wide operation id: unserialized, two saves at once took each other's ids (one waited for
    # a signal never sent) or wrote into one temporary directory ("Directory not empty").
    commits: list[CheckpointCommit] = []
    cks = [SliceCheckpointer(tmp_path / f"s{i}", job="j", slice_name=f"s{i}", max_to_keep=2, commit=commits.append)
           for i in range(4)]
    errors: list[BaseException] = []

    def save_all(ck: SliceCheckpointer) -> None:
        try:
            for step in range(1, 9):
                ck.save(step, {"p": [np.full((64,), step, np.float32)]})
            ck.wait(timeout_s=60)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=save_all, args=(ck,), daemon=True) for ck in cks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not [t for t in threads if t.is_alive()], "a save hung"
    assert errors == []
    assert sorted((c.slice_name, c.step) for c in commits) == [(f"s{i}", s) for i in range(4) for s in range(1, 9)]
    for ck in cks:
        ck.close()


class _CorruptedOnTheWay(SliceCheckpointer):
    """A checkpointer whose step ``bad`` reaches the disk with bytes flipped after Orbax finalized it (a write
    corrupted on the way: the host copy, and so the checksum, are right)."""

    bad = -1

    def _finalized_path(self, step: int) -> Path | None:
        path = super()._finalized_path(step)
        if path is not None and step == self.bad:
            f = largest_file(path)
            data = bytearray(f.read_bytes())
            data[len(data) // 2: len(data) // 2 + 64] = b"\x5a" * 64
            f.write_bytes(bytes(data))
        return path


def test_a_step_corrupted_on_disk_is_not_committed_and_its_predecessor_is_kept(tmp_path: Path) -> None:
    rec = Recorder()
    with captured_events() as logs:
        ck = _CorruptedOnTheWay(tmp_path / "s0", job="j", slice_name="s0", max_to_keep=1, commit=rec)
        ck.bad = 20
        try:
            ck.save(10, states_at(10, n=100_000))
            ck.wait()
            ck.save(20, states_at(20, n=100_000))
            with pytest.raises(CheckpointError, match="not on disk as it was saved"):
                ck.wait()
            # main: step 20 was committed with the checksum of memory and retention deleted step 10, the good one
            assert [c.step for c in rec.commits] == [10]
            assert 10 in ck.steps_on_disk()
            assert_bitwise(restore_commit(rec.commits[0], tmp_path / "s0"), states_at(10, n=100_000))
            assert [e["step"] for e in logs if e["event"] == "checkpoint.unverified"] == [20]
            assert [e["step"] for e in logs if e["event"] == "checkpoint.verified"] == [10]
            ck.save(30, states_at(30, n=100_000))  # the next good step counts, and only then does 10 go
            ck.wait()
            assert [c.step for c in rec.commits] == [10, 30] and 10 not in ck.steps_on_disk()
        finally:
            ck.close()
