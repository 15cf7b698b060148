"""What a source reads on a worker when the run skips batches (recovery/skips.py): the stream position its step
moves to, but for a clock, which reads the step; a host source is asked for the positions in its slice's order.
And the same in the in-process reference, so a cluster run with rollbacks and a reference given its skips read
the same batches (on a real cluster: tests/integration/test_spikes.py)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from rallypoint.client import Program
from rallypoint.client.compile import compile_program
from rallypoint.client.jobspec import job_spec
from rallypoint.client.program import ProgramError
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.skips import Skips
from rallypoint.workers.errors import LoadError
from rallypoint.workers.runtime.control import JobControl
from rallypoint.workers.runtime.inputs import Inputs
from rallypoint.workers.runtime.load import LoadedNode, load_skips
from rallypoint.workers.runtime.outlog import OutputLog
from rallypoint.workers.runtime.state import NodeProgress
from rallypoint.workers.sources.host import instance_order

B = pb.InputBinding


def _args(skips: Skips, *, clock: bool, step: int) -> list[Any]:
    control = JobControl("j", cluster="c", worker_id="here", admit=lambda to: None, incarnation=lambda: 1,
                         outlog=OutputLog(1 << 20))
    prog = pb.NodeProgram(name="src", slice="s", every=1, clock=clock,
                          inputs=[B(arg="step", kind=B.STEP, leaves=1), B(arg="microbatch", kind=B.MICROBATCH, leaves=1)])
    node = LoadedNode(prog, object(), (-1,), NodeProgress(1, (-1,), 20))  # type: ignore[arg-type]
    return Inputs(control, {"src": node}, {}, steps=20, microbatches=1, skips=skips).take(node, step, -1)


def test_a_source_on_a_worker_reads_the_position_its_step_moves_to_and_a_clock_reads_the_step() -> None:
    skips = Skips.parse(["3:4"])
    assert [int(a) for a in _args(skips, clock=False, step=3)] == [7, 0]
    assert [int(a) for a in _args(skips, clock=False, step=2)] == [2, 0]
    assert [int(a) for a in _args(skips, clock=True, step=3)] == [3, 0]
    assert [int(a) for a in _args(Skips(), clock=False, step=3)] == [3, 0]


def test_a_host_source_is_asked_for_the_positions_in_its_slices_order() -> None:
    assert list(instance_order(7, 1, 1, (-1,), Skips.parse(["2:2"]))) == [(1, 0), (4, 0), (5, 0), (6, 0), (7, 0),
                                                                          (8, 0)]
    assert list(instance_order(6, 0, 2, (0, 1), Skips.parse(["2:1"]))) == [(0, 0), (0, 1), (3, 0), (3, 1), (5, 0),
                                                                          (5, 1)]


def test_a_load_with_skips_that_are_not_sorted_and_apart_is_refused_before_anything_loads() -> None:
    req = pb.LoadJobRequest(job="j", skips=[pb.SkipRange(start=5, count=2), pb.SkipRange(start=1, count=1)])
    assert load_skips(req).to_json() == [[1, 1], [5, 2]]  # merged and sorted
    req = pb.LoadJobRequest(job="j", skips=[pb.SkipRange(start=-1, count=2)])
    with pytest.raises(LoadError, match="job 'j': its skipped stream positions are refused"):
        load_skips(req)


def _clocked() -> Program:
    prog = Program("clocked", steps=6, checkpoint_every=2)
    s = prog.slice("s", devices=1)
    w = prog.state("w", slice=s, init=lambda: jnp.zeros((), jnp.float32))
    clock = prog.source("clock", lambda step, mb: {"t": step}, slice=s, outputs=("t",), per="step", clock=True)
    data = prog.source("data", lambda step, mb: {"x": step.astype(jnp.float32)}, slice=s, outputs=("x",), per="step")

    def train(w: Any, t: Any, x: Any) -> dict[str, Any]:
        return {"w": w + x, "t": t.astype(jnp.float32), "x": x}

    node = prog.node("train", train, slice=s, inputs={"w": w, "t": clock["t"], "x": data["x"]},
                     outputs=("w", "t", "x"), updates={"w": w})
    prog.metric("t", node["t"])
    prog.metric("x", node["x"])
    return prog


def test_the_reference_reads_the_skipped_stream_as_a_worker_does_and_a_clock_goes_on_from_the_step() -> None:
    compiled = compile_program(_clocked())
    assert [n.clock for n in job_spec(compiled).nodes] == [True, False, False]
    got = ReferenceExecutor(compiled, skips=Skips.parse(["2:3"])).run()
    assert [m["t"] for m in got.metrics] == [0, 1, 2, 3, 4, 5]
    assert [m["x"] for m in got.metrics] == [0, 1, 5, 6, 7, 8]
    assert float(np.asarray(got.states["w"])) == 27.0


def test_a_host_clock_is_refused() -> None:
    prog = Program("p", steps=2)
    s = prog.slice("s", devices=1)
    with pytest.raises(ProgramError, match="a clock is a JAX source of the step"):
        prog.source("c", lambda step, mb: {"t": step}, slice=s, outputs=("t",), host=True, clock=True)
