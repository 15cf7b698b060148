"""The ``corrupt`` fault on real processes: a worker that silently flips a bit of a slice's state.

A local cluster whose worker has the hook: a run with nothing armed ends bitwise equal to the reference; a
run with ``corrupt`` armed at a step ends in another digest, the corrupted state one element off. And
``rallypoint run --fail corrupt:SLICE@STEP`` on its embedded cluster says the digest differs from the
reference's (urgent.py, a tiny two-slice job). The scenario of the chaos harness: tests/chaos/test_scenarios.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rallypoint.client.commands.faults import Fault
from rallypoint.client.compile import compile_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.cluster.local import LocalCluster
from rallypoint.workers.faults import WorkerFaults
from tests.helpers.cli import rp
from tests.helpers.cluster import counter_job, run

STEPS = 6


def test_a_corrupt_fault_armed_at_a_step_changes_the_final_digest_and_an_unarmed_run_matches(
        local_cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    flag = tmp_path / "corrupt-fault.json"
    lc = local_cluster(workers=1, coordinators=1, worker_faults=WorkerFaults(corrupt_flag=str(flag)))
    clean, sdc = (compile_program(counter_job(STEPS, name)) for name in ("clean", "sdc"))
    want = {c.program.name: ReferenceExecutor(c).run() for c in (clean, sdc)}

    result, _ = run(lc, clean, [], checkpoint_every=3)  # the hook is there, nothing is armed
    assert result.state_digest == want["clean"].state_digest
    assert not flag.exists()

    result, injector = run(lc, sdc, [Fault("only", "only", 2, "corrupt")], checkpoint_every=3,
                           corrupt_flag=str(flag))
    (armed,) = injector.fired
    assert armed["armed"] and armed["worker"] == "w0" and armed["mode"] == "persist", armed
    assert result.state_digest != want["sdc"].state_digest
    got, ref = np.asarray(result.states["total"]), np.asarray(want["sdc"].states["total"])
    assert got[0] != ref[0] and np.array_equal(got[1:], ref[1:]), (got, ref)  # element 0 of the one leaf only


def test_run_fail_corrupt_says_the_digest_differs_from_the_reference(tmp_path: Path) -> None:
    state = {"RALLYPOINT_STATE_DIR": str(tmp_path / "state")}
    out = rp("run", "examples/urgent.py", "--steps", "8", "--fail", "corrupt:add@3", "--json", "--rm",
             timeout=300, env=state)
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    kinds = [x["event"] for x in lines if x["event"] != "step"]
    assert kinds == ["fault.injected", "digest.compared", "job.finished"], kinds
    armed, compared, finished = (x for x in lines if x["event"] != "step")
    assert armed["armed"] and armed["slice"] == "a" and armed["step"] == 3 and armed["mode"] == "persist", armed
    assert compared["equal"] is False and compared["state_digest"] == finished["state_digest"]
    assert compared["reference_digest"] != finished["state_digest"] and not finished["failures"]
    bad = rp("run", "examples/urgent.py", "--cluster", "127.0.0.1:1", "--fail", "corrupt:a@3", check=False, env=state)
    assert bad.returncode == 1 and "only an embedded cluster's workers" in bad.stderr, bad.stderr
