"""Every job commits its final state: a slice's checkpoint schedule ends with a save at ``steps``
(whatever ``checkpoint_every`` is), and a final save that failed is tried again until it counts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.faults import WorkerFaults
from rallypoint.workers.runtime import checkpoints as checkpoints_mod
from rallypoint.workers.runtime.checkpoints import JobCheckpoints
from tests.conftest import wait_until

STATES = {"w": [np.arange(8, dtype=np.float32)]}


def job_checkpoints(root: Path, *, steps: int, every: int, start: int = 0,
                    faults: WorkerFaults = WorkerFaults()) -> tuple[JobCheckpoints, list[int]]:
    counted: list[int] = []
    req = pb.LoadJobRequest(job="j", steps=steps, checkpoint_every=every, checkpoint_dir=str(root), start_step=start,
                            slices=[pb.SliceAssignment(slice="s0", devices=[0])],
                            states=[pb.StateProgram(name="w", slice="s0", leaves=1)])
    commits: list[CheckpointCommit] = []
    jc = JobCheckpoints(req, commit_factory=lambda: commits.append, log_fields={}, faults=faults,
                        on_commit=lambda s, step: counted.append(step))
    return jc, counted


def test_the_schedule_ends_with_the_final_cut_at_steps(tmp_path: Path) -> None:
    jc, counted = job_checkpoints(tmp_path, steps=25, every=10)
    try:
        saved = []
        while (c := jc.due("s0", low=25)) is not None:  # every instance ran: each save that is due, in order
            jc.save("s0", c, STATES)
            saved.append(c)
        assert saved == [10, 20, 25] and jc.barrier("s0") == math.inf
        wait_until(lambda: sorted(counted) == [10, 20, 25], 60, "the three commits, the final one at step 25")
        assert jc.due("s0", low=24) is None  # not before the last step ran
    finally:
        jc.close()
    resumed, _ = job_checkpoints(tmp_path / "r", steps=25, every=10, start=25)  # resumed at its final cut
    try:
        assert resumed.barrier("s0") == math.inf and resumed.due("s0", low=25) is None
    finally:
        resumed.close()


def test_a_failed_final_save_is_tried_again_until_it_counts(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(checkpoints_mod, "FINAL_RETRY_S", 0.2)
    flag = tmp_path / "full"
    flag.write_text("ENOSPC")
    jc, counted = job_checkpoints(tmp_path / "run", steps=4, every=10, faults=WorkerFaults(storage_flag=str(flag)))
    try:
        assert jc.due("s0", low=4) == 4
        try:
            jc.save("s0", 4, STATES)
        except OSError:
            jc.save_failed("s0", 4)  # what the runtime does with a save that raised
        assert jc.due("s0", low=4) is None  # not at once: after FINAL_RETRY_S
        flag.unlink()  # the disk has room again
        wait_until(lambda: jc.due("s0", low=4) == 4, 10, "the final save due again")
        jc.save("s0", 4, STATES)
        wait_until(lambda: counted == [4], 60, "the final cut's commit")
    finally:
        jc.close()
