"""The bad-input traps of a training loop, caught as the cluster catches them: a metric that is not finite
stops the reference as it stops a cluster run (one ``--on-nonfinite`` policy), a JAX source whose trace
bakes in NumPy randomness is refused at compile, and a host source's 64-bit arrays are treated alike
in the reference and on the worker (converted once, with a warning, unless x64 is on)."""

from __future__ import annotations

import json
import textwrap
import warnings
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from rallypoint.client import Program
from rallypoint.client.commands.main import main
from rallypoint.client.compile import compile_program
from rallypoint.client.program import ProgramError
from rallypoint.client.reference import NonFiniteStopped, ReferenceExecutor, run_reference
from rallypoint.client.source_checks import DtypeWarning
from rallypoint.workers.sources.values import describe_mismatch, to_dtypes

BAD_FROM = 7


def diverging(name: str) -> Program:
    """A state ``w`` and a loss that is finite before step ``BAD_FROM`` and log(-1) = nan from it on (the job of
    tests/integration/test_nonfinite.py, which a cluster stops)."""
    prog = Program(name, steps=12, checkpoint_every=2)
    s = prog.slice("s", devices=1)
    w = prog.state("w", slice=s, init=lambda: jnp.ones((4,), jnp.float32))
    data = prog.source("data", lambda step, mb: {"t": step.astype(jnp.float32)}, slice=s, outputs=("t",), per="step")

    def train(w: Any, t: Any) -> dict[str, Any]:
        return {"w": w * 0.9, "loss": jnp.where(t >= BAD_FROM, jnp.log(-1.0), jnp.sum(w) / (1.0 + t))}

    node = prog.node("train", train, slice=s, inputs={"w": w, "t": data["t"]}, outputs=("w", "loss"), updates={"w": w})
    prog.metric("loss", node["loss"])
    return prog


def test_the_reference_stops_at_a_nonfinite_metric_with_the_clusters_words() -> None:
    with pytest.raises(NonFiniteStopped) as info:
        run_reference(diverging("nan-ref"))
    assert (f"job 'nan-ref' failed: metric 'loss' is nan at step {BAD_FROM} (--on-nonfinite stop): the job stopped "
            "there; the reference run keeps no checkpoints") in str(info.value)


def test_the_reference_warns_once_per_metric_and_goes_on() -> None:
    events: list[dict[str, Any]] = []
    got = ReferenceExecutor(compile_program(diverging("nan-warn-ref")), on_nonfinite="warn",
                            on_event=events.append).run()
    assert [(e["event"], e["step"], e["metric"], e["action"]) for e in events] == [
        ("job.nonfinite", BAD_FROM, "loss", "warn")]
    assert len(got.metrics) == got.steps


JOB = '''
import jax.numpy as jnp
from rallypoint.client import Program

def build(steps=6):
    prog = Program("inf-ref", steps=steps)
    s = prog.slice("s", devices=1)
    w = prog.state("w", slice=s, init=lambda: jnp.ones((2,), jnp.float32))
    data = prog.source("data", lambda step, mb: step.astype(jnp.float32), slice=s, per="step")
    node = prog.node("train", lambda w, t: {{"w": w * 2e30, "loss": jnp.sum(w) * t}}, slice=s,
                     inputs={{"w": w, "t": data.ref}}, outputs=("w", "loss"), updates={{"w": w}})
    prog.metric("loss", node["loss"])
    return prog

program = build()
'''


@pytest.mark.parametrize("mode", ["", "warn"])
def test_rallypoint_run_reference_exits_1_on_an_inf_loss_unless_warned(tmp_path: Path, mode: str) -> None:
    job = tmp_path / "inf_job.py"
    job.write_text(textwrap.dedent(JOB.format()))
    r = CliRunner().invoke(main, ["run", "--reference", "--json", *(["--on-nonfinite", mode] if mode else []),
                                  str(job)])
    lines = [json.loads(x) for x in r.output.splitlines() if x.startswith("{")]
    if not mode:
        assert r.exit_code == 1, r.output
        assert "metric 'loss' is inf at step 2 (--on-nonfinite stop): the job stopped there" in r.output
        assert not [x for x in lines if x["event"] == "job.finished"]
    else:
        assert r.exit_code == 0, r.output
        assert [x["step"] for x in lines if x["event"] == "job.nonfinite"] == [2]
        assert lines[-1]["event"] == "job.finished"


def _source_program(source: Any) -> Program:
    prog = Program("src", steps=2)
    s = prog.slice("s", devices=1)
    w = prog.state("w", slice=s, init=lambda: jnp.zeros((4,), jnp.float32))
    data = prog.source("data", source, slice=s, per="step")
    prog.node("train", lambda w, x: w + x, slice=s, inputs={"w": w, "x": data.ref}, outputs=("w",), updates={"w": w})
    return prog


def test_a_jax_source_that_bakes_in_numpy_randomness_is_refused_pointing_at_host_sources() -> None:
    with pytest.raises(ProgramError) as info:
        compile_program(_source_program(lambda step, mb: np.random.rand(4) + step))  # the probe, as a user wrote it
    assert "source 'data': a value its Python computes at trace time (a float32[4] array) differs" in str(info.value)
    assert "host=True" in str(info.value) and "host_source=True" in str(info.value)
    table = np.arange(4, dtype=np.float32)  # a constant that is the same each time: what the user meant
    compile_program(_source_program(lambda step, mb: jnp.asarray(table) * step))


def f64_source(step, microbatch):
    return {"x": np.full((3, 1), step, dtype=np.float64), "y": np.arange(3) + step}  # NumPy's defaults


def test_a_float64_host_source_is_converted_once_with_a_warning_in_the_reference_as_on_the_cluster() -> None:
    prog = Program("f64", steps=3)
    s = prog.slice("s", devices=1)
    w = prog.state("w", slice=s, init=lambda: jnp.zeros((3, 1), jnp.float32))
    data = prog.source("data", f64_source, slice=s, per="step", outputs=("x", "y"), host=True)
    prog.node("train", lambda w, x, y: w + x + y[:, None], slice=s, inputs={"w": w, "x": data["x"], "y": data["y"]},
              outputs=("w",), updates={"w": w})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = compile_program(prog)
    said = [str(w.message) for w in caught if issubclass(w.category, DtypeWarning)]
    assert len(said) == 1 and "x (float64 -> float32), y (int64 -> int32)" in said[0], said
    assert [a.dtype for a in compiled.nodes["data"].out_avals.values()] == [np.float32, np.int32]
    got = ReferenceExecutor(compiled).run()
    assert got.states["w"].dtype == np.float32 and float(got.states["w"][0, 0]) == 0 + 1 + 2 + 3
    leaves = [np.zeros((3, 1)), np.arange(3)]  # what the worker reads from the source process
    assert [a.dtype for a in to_dtypes(leaves, [np.float32, np.int32])] == [np.float32, np.int32]
    assert to_dtypes([np.zeros(2, np.int32)], [np.float32])[0].dtype == np.int32  # a real mismatch stays one
    assert describe_mismatch([(np.int32, (3, 1)), (np.int32, (3,))], [(np.float32, (3, 1)), (np.int32, (3,))]) == \
        "array 0 is int32[3, 1], at submit float32[3, 1]"
