"""A gang member lost while the job's final state is fetched, on a real cluster: the lead's fetch gathers the
slice's state from the members' shards, so it fails naming the member; the executor recovers that member's loss
(the gang formed anew, replayed to the end) and fetches again, and the run ends bitwise equal to the one without
the loss (orchestrator/job/finish.py, docs/multihost.md)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rallypoint.client.compile import compile_program
from rallypoint.client.submission import submit
from rallypoint.cluster.local import LocalCluster
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from tests.conftest import read_events, wait_until
from tests.examples import example
from tests.helpers.cluster import job_record

STEPS = 6


def test_a_gang_member_lost_as_the_final_state_is_fetched_is_recovered_and_the_job_ends_bitwise_equal(
    local_cluster: Callable[..., LocalCluster], tmp_path: Path,
) -> None:
    gate = tmp_path / "finish-gate"
    gate.mkdir()
    lc = local_cluster(workers=4, spares=0, devices_per_worker=2, coordinators=1,
                       coordinator_hooks=ExecutorHooks(finish_gate=str(gate)))
    compiled = compile_program(example("data_parallel").build(steps=STEPS, devices=4))  # no worker has 4: a gang
    job = compiled.program.name
    settings: dict[str, Any] = {"checkpoint_every": 2, "warm_spares": 0}  # no member processes started ahead: each
    # costs a JAX import of CPU on a small machine
    (gate / f"{job}.go").touch()  # the run without the loss passes the gate
    reference = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, **settings)
    (gate / f"{job}.go").unlink()
    (gate / f"{job}.finishing").unlink()

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, new_run=True,
                                   **settings)
        except Exception as exc:  # the assertion below names it
            out["error"] = exc

    t = threading.Thread(target=run, name="submit")
    t.start()
    try:
        # Every step is done and the job is FINISHING: its final state is about to be fetched. Member 1 of the gang
        # (its worker) is SIGKILLed now, before the fetch asks the lead, which then finds it lost.
        wait_until(lambda: (gate / f"{job}.finishing").exists() or "error" in out or "result" in out, 300,
                   "the job to enter FINISHING")
        members = [m["worker"] for m in job_record(lc, job)["placement"]["dp"]["members"]]
        lc.signal(members[1], signal.SIGKILL)
        lc.reap(members[1])
    finally:
        (gate / f"{job}.go").touch()
        t.join(300)
    assert not t.is_alive(), "the run did not end"
    assert "error" not in out, out["error"]
    result = out["result"]
    assert result.state_digest == reference.state_digest, result.recovery
    [rec] = result.recovery["recoveries"]
    assert {members[0], members[1]} <= set(rec["reasons"]), rec  # the member, and its slice's lead with it
    now = [m["worker"] for m in job_record(lc, job)["placement"]["dp"]["members"]]
    assert len(now) == 2 and members[1] not in now, (members, now)
    # The lead's fetch failed naming the member (typed, so the executor counts it as that member's loss even before
    # the member's registration is gone; finish.py); the executor recovered the loss and fetched again.
    told = read_events(lc.process(members[0]).log, "fetch.member_lost")
    assert [(e["member"], e["member_worker"]) for e in told] == [(1, members[1])], told
    coordinator = next(p for p in lc.processes if p.role == "coordinator")
    finishing = read_events(coordinator.log, "job.lost_while_finishing")
    assert finishing and members[1] in finishing[-1]["lost"], finishing
