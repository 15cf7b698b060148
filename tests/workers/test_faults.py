"""Worker fault hooks: injected configuration (WorkerFaults), never environment variables.

A job's checkpoints honour the commit delay and the storage flag they are given; the
worker command and the local cluster carry them to every worker as hidden options.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from rallypoint.cluster import daemons
from rallypoint.workers import daemon as worker_daemon
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.basics.errors import ConfigError
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.faults import NO_FAULTS, WorkerFaults
from rallypoint.workers.runtime.checkpoints import JobCheckpoints
from tests.conftest import wait_until

STATES = {"w": [np.arange(16, dtype=np.float32)]}


class Checkpoints:
    """JobCheckpoints of one slice ``s0`` saving every 2 steps, with recorded commits."""

    def __init__(self, root: Path, faults: WorkerFaults) -> None:
        self.commits: list[tuple[CheckpointCommit, float]] = []
        self.counted: list[int] = []
        req = pb.LoadJobRequest(job="j", steps=10, checkpoint_every=2, checkpoint_dir=str(root),
                                slices=[pb.SliceAssignment(slice="s0", devices=[0])],
                                states=[pb.StateProgram(name="w", slice="s0", leaves=1)])
        self.jc = JobCheckpoints(req, commit_factory=lambda: self.commit, log_fields={}, faults=faults,
                                 on_commit=lambda s, step: self.counted.append(step))

    def commit(self, c: CheckpointCommit) -> None:
        self.commits.append((c, time.monotonic()))


@pytest.fixture
def checkpoints(tmp_path: Path) -> Any:
    made: list[Checkpoints] = []

    def make(faults: WorkerFaults = NO_FAULTS) -> Checkpoints:
        made.append(Checkpoints(tmp_path / f"run{len(made)}", faults))
        return made[-1]

    try:
        yield make
    finally:
        for c in made:
            c.jc.close()


def test_the_commit_waits_the_injected_delay_after_orbax_finalized(checkpoints: Any) -> None:
    ck = checkpoints(WorkerFaults(commit_delay_s=1.0))
    ck.jc.save("s0", 2, STATES)
    wait_until(lambda: any((Path(ck.jc.root) / "s0").glob("*/2")) or bool(ck.commits), 30, "orbax to finalize")
    t_disk = time.monotonic()
    wait_until(lambda: ck.counted == [2], 30, "the commit")
    (c, t_commit), = ck.commits
    assert c.step == 2 and t_commit - t_disk >= 0.8, "the commit should wait about 1 s after the checkpoint is on disk"


def test_without_faults_the_commit_follows_at_once(checkpoints: Any) -> None:
    ck = checkpoints()
    t0 = time.monotonic()
    ck.jc.save("s0", 2, STATES)
    wait_until(lambda: ck.counted == [2], 30, "the commit")
    assert ck.commits[0][1] - t0 < 5


@pytest.mark.parametrize("name", ["ENOSPC", "EROFS"])
def test_saves_fail_with_the_flags_errno_while_the_flag_file_exists(checkpoints: Any, tmp_path: Path,
                                                                   name: str) -> None:
    flag = tmp_path / "storage-fault"
    ck = checkpoints(WorkerFaults(storage_flag=str(flag)))
    ck.jc.save("s0", 2, STATES)  # no flag file: saves work
    flag.write_text(name)
    with pytest.raises(OSError) as info:
        ck.jc.save("s0", 4, STATES)
    assert info.value.errno == getattr(errno, name)
    flag.unlink()
    ck.jc.save("s0", 6, STATES)
    wait_until(lambda: ck.counted == [2, 6], 30, "the commits of steps 2 and 6")


def test_the_old_environment_variables_are_not_read(checkpoints: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    flag = tmp_path / "storage-fault"
    flag.write_text("ENOSPC")
    monkeypatch.setenv("RALLYPOINT_FAULT_STORAGE_FLAG", str(flag))
    monkeypatch.setenv("RALLYPOINT_FAULT_COMMIT_DELAY_S", "30")
    ck = checkpoints()
    ck.jc.save("s0", 2, STATES)
    wait_until(lambda: ck.counted == [2], 10, "the commit (no injected delay, no injected error)")


def test_faults_validate_and_become_hidden_worker_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="commit_delay_s"):
        WorkerFaults(commit_delay_s=-1)
    assert NO_FAULTS.args() == [] and not NO_FAULTS.any
    faults = WorkerFaults(commit_delay_s=3, storage_flag=str(tmp_path / "flag"), corrupt_replicas=True)
    assert faults.args() == ["--fault-commit-delay-s", "3.0", "--fault-storage-flag", str(tmp_path / "flag"),
                             "--fault-corrupt-replicas"]

    cfg = LocalClusterConfig(state_dir=tmp_path / "c", worker_faults=faults)
    lc = LocalCluster(cfg, ["127.0.0.1:1"], [])
    argv = lc.argv("worker", "w0")
    assert argv[-5:] == faults.args()
    assert "--fault-commit-delay-s" not in lc.argv("coordinator", "c0")
    assert "--fault-commit-delay-s" not in LocalCluster(LocalClusterConfig(state_dir=tmp_path / "d"), ["x:1"],
                                                        []).argv("worker", "w0")
    (tmp_path / "c").mkdir()
    lc.save()  # `rallypoint down` reads the config back
    assert LocalCluster.load(tmp_path / "c").config == cfg


def test_the_worker_command_hands_its_cache_and_hidden_fault_options_to_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    configs: list[Any] = []

    class FakeDaemon:
        def __init__(self, config: Any) -> None:
            configs.append(config)
            self.start = self.run = self.request_stop = self.stop = lambda: None
            self.request_preemption = lambda: None

    monkeypatch.setattr(worker_daemon, "WorkerDaemon", FakeDaemon)  # the worker command imports it when it runs
    monkeypatch.setattr(daemons, "configure_logs", lambda: None)
    base = ["worker", "--cluster", "t@127.0.0.1:1", "--id", "w0", "--insecure"]
    r = CliRunner().invoke(daemons.main, [*base, "--fault-commit-delay-s", "2.5", "--fault-storage-flag", "/f",
                                          "--fault-corrupt-replicas", "--compile-cache-dir", "/shared/cache"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(daemons.main, base)
    assert r.exit_code == 0, r.output
    assert [c.faults for c in configs] == [WorkerFaults(commit_delay_s=2.5, storage_flag="/f", corrupt_replicas=True),
                                           NO_FAULTS]
    assert [c.compile_cache_dir for c in configs] == ["/shared/cache", ""]
    help_text = CliRunner().invoke(daemons.main, ["worker", "--help"]).output
    assert "--fault" not in help_text and "--compile-cache-dir" in help_text


def test_a_drain_step_asked_again_with_every_grant_is_saved_once(checkpoints: Any) -> None:
    """Every grant of a drain carries its step; once the slice saved it, asking again must not make the slice
    save it a second time (which Orbax refuses: it was logged as a skipped checkpoint, an error)."""
    ck = checkpoints()
    ck.jc.save("s0", 4, STATES)  # the schedule's (every 2)
    ck.jc.save_at(5)
    assert ck.jc.due("s0", 5) == 5
    ck.jc.save("s0", 5, STATES)
    ck.jc.save_at(5)  # the next grant of the same drain
    assert ck.jc.barrier("s0") == 6 and ck.jc.due("s0", 5) is None
    wait_until(lambda: ck.counted == [4, 5], 30, "the commits")
