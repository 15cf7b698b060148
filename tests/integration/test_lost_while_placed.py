"""A worker SIGKILLed between its device lease and the load, on a real cluster: real etcd, real worker processes.

The leader runs in the test's process (``leader_in_process``) so that its executor carries the test's hook,
``ExecutorHooks.leased``: once the placement has leased every slice, the hook kills the worker chosen for a slice
and waits until its registration is gone from etcd, then the placement goes on. The job must be recovered like
any loss and end bitwise equal to the fault-free reference (docs/recovery.md, "Lost while the job is placed or loaded").
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping

from rallypoint.client.compile import CompiledProgram
from rallypoint.cluster.local import LocalCluster
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from tests.conftest import wait_until
from tests.helpers.cluster import assert_settled, leader_in_process, nodes_of, run, snapshot


def test_a_worker_killed_between_its_lease_and_the_load_is_recovered_and_the_job_ends_bitwise(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=1)
    killed: list[str] = []

    def kill_stage1(placed: Mapping[str, tuple[str, ...]]) -> None:
        if killed:  # only the first placement (the recovery's remap places no job)
            return
        (victim,) = placed["stage1"]
        killed.append(victim)
        lc.signal(victim, signal.SIGKILL)
        wait_until(lambda: victim not in snapshot(lc).workers, 15, f"{victim}'s registration to go")

    with leader_in_process(lc, ExecutorHooks(leased=kill_stage1)):
        result, _ = run(lc, compiled, [])
    (victim,) = killed
    assert result.state_digest == reference, "a loss while the job was placed"
    rec = result.recovery
    assert [(f["worker"], f["slices"]) for f in rec["failures"]] == [(victim, ["stage1"])]
    (r,) = rec["recoveries"]
    assert r["checkpoint_step"] == 0 and set(r["moved"]) == {"stage1"} and r["moved"]["stage1"] != victim
    assert set(rec["replayed_instances"]) <= nodes_of(compiled, "stage1")
    assert_settled(lc)
