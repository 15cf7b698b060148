"""A slice with no state of its own on a real local cluster: examples/pipeline_eval.py, whose slice ``eval`` holds
a per-step source and a node that reads two pipeline stages' parameters every 3 steps.

Such a slice saves no checkpoint, so no commit says how far it got. Restarted from a cut it had not reached, it
would skip the steps between, and the job would wait on them until its stall budget ran out. The job must end
bitwise equal to the fault-free reference when the evaluator's worker dies behind the cut the stages committed.
(Kills, hangs and partitions of every slice's worker: scenarios/stateless-eval.toml, run by the chaos suite.)
"""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Callable
from pathlib import Path


from rallypoint.client.commands.faults import Fault, FaultInjector
from rallypoint.client.compile import compile_program
from rallypoint.client.jobfile import load_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.submission import submit
from rallypoint.cluster.local import LocalCluster
from rallypoint.basics.errors import StoreError
from rallypoint.etcd.commits import read_commits
from tests.conftest import wait_until
from tests.examples import EXAMPLES
from tests.helpers.cluster import assert_settled

STEPS = 24
STAGES = ("stage0", "stage1", "stage2", "stage3")

# examples/pipeline_eval.py with the evaluator's held-out data a host source that waits at step BLOCK_AT while the flag file exists: the stages
# run on to the end of the window (BLOCK_AT + 2) and commit there, past the evaluator's progress.
BLOCK_AT = 13
JOB = '''
import os
import time

import numpy as np

FLAG = {flag!r}
BLOCK_AT = {block_at}
EXAMPLE = {example!r}


def held(step, microbatch):
    if step == BLOCK_AT:
        while os.path.exists(FLAG):
            time.sleep(0.02)
    x = np.random.default_rng(step).normal(size=(16, 32)).astype(np.float32)
    return {{"x": x, "y": np.sin(2.0 * x)}}


def build():
    import importlib.util

    from rallypoint.client import StateRef

    spec = importlib.util.spec_from_file_location("pipeline_eval_example", EXAMPLE)
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    prog = ev.pipeline_mlp.build({steps})
    prog.name = "pipeline-eval"
    s = prog.slice("eval", devices=1)
    x = prog.source("held", held, slice=s, per="step", outputs=("x", "y"), host=True)
    err = prog.node("evaluate", ev.evaluate, slice=s, every=ev.EVAL_EVERY,
                    inputs={{"first": StateRef("params1", "stage1"), "second": StateRef("params2", "stage2"),
                            "x": x["x"], "y": x["y"]}}, outputs=("eval_err",))
    prog.metric("eval_err", err["eval_err"])
    return prog
'''


def test_an_evaluator_lost_behind_the_cut_the_stages_committed_restarts_from_where_it_was(
    local_cluster: Callable[..., LocalCluster], tmp_path: Path,
) -> None:
    flag = tmp_path / "hold-eval"
    code = tmp_path / "code"
    code.mkdir()
    (code / "job.py").write_text(textwrap.dedent(JOB).format(flag=str(flag), block_at=BLOCK_AT, steps=STEPS,
                                                             example=str(EXAMPLES / "pipeline_eval.py")))
    compiled = compile_program(load_program(code / "job.py"))
    reference = ReferenceExecutor(compiled).run().state_digest
    flag.touch()
    lc = local_cluster(workers=5, spares=1, devices_per_worker=1, coordinators=1)
    injector = FaultInjector([], lc.endpoints, lc.keys.cluster)
    fired: list[dict[str, object]] = []
    errors: list[BaseException] = []
    ahead = BLOCK_AT + 2  # a checkpoint step: the end of the window while the evaluator waits at BLOCK_AT

    store = lc.store()  # one connection for the polls (a new TLS handshake per poll failed on a loaded host)

    def stages_committed() -> bool:
        try:
            commits = read_commits(store, lc.keys, compiled.program.name)
        except StoreError:
            return False  # etcd busy: ask again
        return all(any(c.step == ahead for c in commits.get(s, ())) for s in STAGES)

    def kill_the_evaluator_behind_the_cut() -> None:
        try:
            wait_until(lambda: "eval" in injector.placement, 120, "the job's placement")
            wait_until(stages_committed, 120, f"every stage's commit at step {ahead}")
            fired.append(injector.kill(Fault("eval", "eval", BLOCK_AT), BLOCK_AT))
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            errors.append(exc)
        finally:
            flag.unlink(missing_ok=True)  # the evaluator's replacement reads step BLOCK_AT at once

    killer = threading.Thread(target=kill_the_evaluator_behind_the_cut, daemon=True)
    killer.start()
    try:
        # Before the fix: the evaluator restarted at the cut (15), step 13 and 14 never ran on it, and the job
        # stalled until its budget ran out ("recovery gave up: stall setbacks 4 > limit 3"). The compile timeout
        # leaves the replacement's host source process time to start on a loaded host.
        result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, on_event=injector.on_event,
                        checkpoint_every=5, stall_timeout_s=60.0, compile_timeout_s=45.0, code_dir=str(code))
    finally:
        flag.unlink(missing_ok=True)
        killer.join(30)
        store.close()
    assert not errors, errors
    assert [f.get("signal") for f in fired] == ["SIGKILL"], fired
    assert result.state_digest == reference
    # The stall timeout (60 s) outlasts the evaluator held at step BLOCK_AT until the kill: a shorter one fired
    # first on a loaded host (the stages slow to commit past it). A loaded host may still add a recovery, which
    # the job survives like any other. Before the fix this one restarted the evaluator at the stages' newer cut and
    # the job stalled on the steps it skipped until its budget ran out.
    r = next(x for x in result.recovery["recoveries"] if fired[0]["worker"] in x["lost"])
    assert r["lost"] == {fired[0]["worker"]: ["eval"]}
    assert r["checkpoint_step"] <= BLOCK_AT, r  # not the stages' newer commits: the evaluator had not reached them
    assert_settled(lc)
