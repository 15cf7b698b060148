"""Warm spares on a real local cluster: real etcd, real worker processes, a real SIGKILL.

The spare compiles the job's programs once the job runs (``job.warmed``); then the
worker of a slice is killed, the slice recovers onto that spare, and its first calls
there take their executables from the warm cache: the recovery record says
``warm`` and no compile seconds, and the job still ends bitwise equal to the
reference. With ``warm_spares=0`` the same kill pays the compile at the first call.
The workers share the persistent compilation cache (the local cluster's default),
which makes a cold compile cheaper but not free: the test asserts on where each
executable came from, not on wall time.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

from rallypoint.client.compile import CompiledProgram, compile_program
from rallypoint.client.commands.faults import Fault, FaultInjector
from rallypoint.client.jobspec import job_spec
from rallypoint.client.program import ProgramError
from rallypoint.client.reference import ReferenceExecutor, RunResult
from rallypoint.client.submission import JobError, submit
from rallypoint.cluster.local import LocalCluster
from rallypoint.proto import rallypoint_pb2 as pb
from tests.examples import example
from tests.helpers.cluster import assert_settled, nodes_of

STEPS = 60
EVERY = 5
VICTIM = "stage2"
SLICES = ("stage0", "stage1", "stage2", "stage3")


@pytest.fixture(scope="module")
def pipeline() -> tuple[CompiledProgram, str]:
    compiled = compile_program(example("pipeline_mlp").build(steps=STEPS))
    return compiled, ReferenceExecutor(compiled).run().state_digest


def kill_once_warm(lc: LocalCluster, compiled: CompiledProgram, *, cold_at: int | None,
                   **recovery: Any) -> tuple[RunResult, list[dict[str, Any]], list[dict[str, Any]]]:
    """Run the job; kill the victim's worker at the first step after the spares are warm
    (``cold_at`` None) or at step ``cold_at``. Returns the result, the job.warmed events, the kill."""
    injector = FaultInjector([], lc.endpoints, lc.keys.cluster)
    warmed: list[dict[str, Any]] = []
    fired: list[dict[str, Any]] = []
    lock = threading.Lock()

    def on_event(ev: pb.JobEvent) -> None:
        injector.on_event(ev)
        if ev.event == "job.warmed":
            warmed.append(json.loads(ev.detail))
        if ev.event != "step.done":
            return
        due = (any(w["plan"] for w in warmed) if cold_at is None else ev.step + 1 >= cold_at)
        with lock:
            if due and not fired:
                fired.append(injector.kill(Fault(VICTIM, VICTIM, int(ev.step) + 1), int(ev.step) + 1))

    result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, on_event=on_event,
                    checkpoint_every=EVERY, **recovery)
    assert fired and "error" not in fired[0], (fired, warmed)
    return result, warmed, fired


def test_a_kill_recovers_onto_a_warm_spare_whose_first_calls_compile_nothing_and_ends_bitwise_equal(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=1)
    result, warmed, fired = kill_once_warm(lc, compiled, cold_at=None)
    assert result.state_digest == reference
    first = next(w for w in warmed if w["plan"])
    assert first["reason"] == "placed" and not first["failed"], first
    (spare, slices), = first["plan"].items()
    assert sorted(slices) == sorted(SLICES)  # one spare with room for each: it warms every slice it could take
    assert first["compile_s"][spare] > 0 and first["warm_s"] > 0
    (r,) = result.recovery["recoveries"]
    assert r["moved"] == {VICTIM: spare} and fired[0]["worker"] != spare
    assert r["warm"] == {VICTIM: True}, r
    fc = r["first_calls"][VICTIM]
    print("warm recovery:", json.dumps({"first_calls": r["first_calls"], "phases": r["phases"], "warmed": first}))
    assert fc == {"source": "warm", "compile_s": 0.0, "nodes": len(nodes_of(compiled, VICTIM))}, fc
    assert set(r["replay_nodes"]) == nodes_of(compiled, VICTIM)
    assert_settled(lc)


def test_without_warm_spares_the_same_kill_pays_the_compile_at_the_first_call(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=1)
    result, warmed, _ = kill_once_warm(lc, compiled, cold_at=12, warm_spares=0)
    assert result.state_digest == reference
    assert warmed == []  # off: no spare was asked to warm anything
    (r,) = result.recovery["recoveries"]
    assert r["warm"] == {VICTIM: False}, r
    fc = r["first_calls"][VICTIM]
    print("cold recovery:", json.dumps({"first_calls": r["first_calls"], "phases": r["phases"]}))
    assert fc["source"] == "compiled" and fc["compile_s"] > 0 and fc["nodes"] == len(nodes_of(compiled, VICTIM)), fc
    assert_settled(lc)


def test_a_negative_warm_spares_is_refused_naming_the_field(pipeline: tuple[CompiledProgram, str]) -> None:
    with pytest.raises(ProgramError, match="warm_spares"):
        job_spec(pipeline[0], warm_spares=-1)


def test_the_coordinator_refuses_a_negative_warm_spares_naming_the_field(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    compiled = compile_program(example("pipeline_mlp").build(steps=2))
    lc = local_cluster(workers=4, spares=0, devices_per_worker=1, coordinators=1)
    spec = job_spec(compiled)
    spec.warm_spares = -2  # past the client's check, as another client might send it
    from rallypoint.client import submission as submit_mod

    with pytest.raises(JobError, match="warm_spares must be >= 0"):
        submit_mod._follow(spec.job, lc.endpoints, lc.keys.cluster, lambda stub: stub.SubmitJob(spec),
                           on_step=lambda *_: None, on_event=None, follow_s=10.0)
