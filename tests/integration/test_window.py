"""The window of steps in flight on a real local cluster: the leader decides it from the checkpoint interval,
and a slice runs that far ahead of the steps the leader has seen complete, without waiting for it.

Two independent slices in one job: ``fast`` (a counter) and ``slow``, whose host source waits at step
``BLOCK_AT`` while a flag file exists. The job's completed steps stop at ``BLOCK_AT`` meanwhile, so how far
``fast`` runs shows how far the grants reach: with the old constant window of 2, never past ``BLOCK_AT + 1``;
with the leader's window of one checkpoint interval (8), at least half of it past the completed steps.
"""

from __future__ import annotations

import json
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

from rallypoint.client.compile import compile_program
from rallypoint.client.jobfile import load_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.submission import submit
from rallypoint.cluster.local import LocalCluster
from rallypoint.proto import rallypoint_pb2 as pb
from tests.conftest import wait_until
from tests.helpers.cluster import assert_settled

STEPS, EVERY, BLOCK_AT = 32, 8, 4
JOB = '''
import os
import time

import jax.numpy as jnp
import numpy as np

from rallypoint.client import Program

FLAG = {flag!r}


def held(step, microbatch):
    if step == {block_at}:
        while os.path.exists(FLAG):
            time.sleep(0.02)
    return {{"x": np.full((4,), step, np.float32)}}


def build():
    prog = Program("ahead", steps={steps}, checkpoint_every={every})
    fast = prog.slice("fast", devices=1)
    total = prog.state("total", slice=fast, init=lambda: jnp.zeros((4,)))
    x = prog.source("x", lambda step, mb: {{"x": jnp.full((4,), step, jnp.float32)}}, slice=fast, per="step",
                    outputs=("x",))
    prog.node("add", lambda total, x: {{"total": total + x}}, slice=fast, inputs={{"total": total, "x": x["x"]}},
              outputs=("total",), updates={{"total": total}})
    slow = prog.slice("slow", devices=1)
    acc = prog.state("acc", slice=slow, init=lambda: jnp.zeros((4,)))
    y = prog.source("held", held, slice=slow, per="step", outputs=("x",), host=True)
    prog.node("mul", lambda acc, x: {{"acc": acc * 0.5 + x}}, slice=slow, inputs={{"acc": acc, "x": y["x"]}},
              outputs=("acc",), updates={{"acc": acc}})
    return prog
'''


def ran_through(lc: LocalCluster, job: str, node: str) -> int:
    """The newest step of ``node`` any worker's instance records hold (workers/runtime/records.py); -1: none."""
    newest = -1
    for path in Path(lc.checkpoint_dir).glob(f"{job}/*/instances/*.jsonl"):
        for line in path.read_text().splitlines()[1:]:  # the first line describes the runtime
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line being written
            if rec.get("n") == node:
                newest = max(newest, int(rec["s"]))
    return newest


def test_the_leaders_window_lets_a_slice_run_a_checkpoint_interval_ahead_and_the_job_ends_equal(
    local_cluster: Callable[..., LocalCluster], tmp_path: Path,
) -> None:
    flag, code = tmp_path / "hold", tmp_path / "code"
    code.mkdir()
    (code / "job.py").write_text(textwrap.dedent(JOB).format(flag=str(flag), block_at=BLOCK_AT, steps=STEPS,
                                                             every=EVERY))
    compiled = compile_program(load_program(code / "job.py"))
    reference = ReferenceExecutor(compiled).run().state_digest
    flag.touch()
    lc = local_cluster(workers=2, spares=0, devices_per_worker=1, coordinators=1)
    started: list[dict[str, object]] = []
    seen: list[int] = []
    errors: list[BaseException] = []

    def on_event(ev: pb.JobEvent) -> None:
        if ev.event == "job.started":
            started.append(json.loads(ev.detail))

    def release_once_fast_ran_ahead() -> None:
        try:  # the slow slice waits at BLOCK_AT: the completed steps stay there while fast runs on
            wait_until(lambda: ran_through(lc, "ahead", "add") >= BLOCK_AT + EVERY // 2 - 1, 60,
                       f"the fast slice past step {BLOCK_AT + EVERY // 2 - 1} while the job waits at {BLOCK_AT}")
            seen.append(ran_through(lc, "ahead", "add"))
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            errors.append(exc)
        finally:
            flag.unlink(missing_ok=True)

    releaser = threading.Thread(target=release_once_fast_ran_ahead, daemon=True)
    releaser.start()
    try:
        result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, on_event=on_event,
                        code_dir=str(code))
    finally:
        flag.unlink(missing_ok=True)
        releaser.join(30)
    assert not errors, errors
    # the window was the leader's (one checkpoint interval), said in job.started and the result
    assert started and started[0]["window"] == EVERY and started[0]["auto"] is True, started
    assert result.recovery["window"] == EVERY
    # with the old window (2), fast could never have run past BLOCK_AT + 1 while the job stood at BLOCK_AT
    assert seen and seen[0] > BLOCK_AT + 2, seen
    assert result.state_digest == reference
    assert_settled(lc)
