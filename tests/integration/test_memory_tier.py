"""The in-memory checkpoint tier on a real local cluster: real etcd, real worker processes, a real SIGKILL.

A pipeline stage's worker is killed; its slice restores on the spare from the copy of
the cut's commit a peer holds in memory, and the run ends bitwise equal to the
fault-free reference. With every in-memory copy corrupted (``--fault-corrupt-replicas``)
the same kill restores from disk, says so, and still ends bitwise.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rallypoint.client.compile import CompiledProgram
from rallypoint.client.commands.faults import Fault
from rallypoint.cluster.local import LocalCluster
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.faults import WorkerFaults
from tests.conftest import read_events, wait_until
from tests.helpers.cluster import run

VICTIM, KILL_AT = "stage2", 13


def restore_events(lc: LocalCluster, worker: str) -> list[dict]:
    return [e for e in read_events(lc.process(worker).log, "checkpoint.restored") if e.get("slice") == VICTIM]


@pytest.mark.parametrize("corrupt", [False, True], ids=["memory", "corrupt-copy-falls-back-to-disk"])
def test_a_killed_stage_restores_from_peer_memory_or_falls_back_to_disk_and_ends_bitwise(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str], corrupt: bool,  # noqa: F811
) -> None:
    compiled, reference = pipeline
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=1,
                       worker_faults=WorkerFaults(corrupt_replicas=corrupt))

    def copy_pushed(ev: pb.JobEvent) -> None:
        """Before the kill, the victim's copy of its newest commit is with its peer: the kill then always finds one
        to restore (or, corrupted, to refuse). On a loaded host the kill came between a commit and its copy's push,
        and the restore read the disk having found no copy at all (CI: "the corrupt copy was not reported")."""
        def newest(event: str) -> int:
            return max((e["step"] for p in lc.processes if p.role == "worker" for e in read_events(p.log, event)
                        if e.get("slice") == VICTIM), default=0)

        if ev.event == "step.done" and ev.step == KILL_AT - 2:  # the injector fires at the next one
            wait_until(lambda: 0 < newest("checkpoint.committed") == newest("replica.pushed"), 30,
                       f"{VICTIM}'s copy of its newest commit pushed")

    result, injector = run(lc, compiled, [Fault(VICTIM, VICTIM, KILL_AT)], on_event=copy_pushed)
    assert result.state_digest == reference
    (r,) = result.recovery["recoveries"]
    tier = "disk" if corrupt else "memory"
    assert r["restore_tiers"] == {VICTIM: tier}, r
    assert r["checkpoint_step"] > 0, "the kill should land after a cut past the inits"
    spare = r["moved"][VICTIM]
    (ev,) = restore_events(lc, spare)
    assert ev["tier"] == tier and ev["step"] == r["checkpoint_step"]
    rejected = read_events(lc.process(spare).log, "replica.corrupt")
    if corrupt:
        assert rejected and rejected[0]["expected"] != rejected[0]["actual"], "the corrupt copy was not reported"
    else:
        assert not rejected
        # The copy came from a peer of the job, not the dead worker and not the spare itself.
        holders = {e["holder"] for e in read_events(lc.process(injector.fired[0]["worker"]).log, "replica.pushed")}
        assert holders and injector.fired[0]["worker"] not in holders and spare not in holders
