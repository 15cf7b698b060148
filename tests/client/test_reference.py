"""The reference executor: the three examples train, deterministically, from exported programs."""

from __future__ import annotations

import io
import pickletools

import jax
import numpy as np
import pytest

from rallypoint.client.compile import compile_program
from rallypoint.client.reference import ReferenceExecutor, run_reference, state_digest
from tests.examples import example



@pytest.mark.parametrize("name,metric,better", [
    ("pipeline_mlp", "loss", "lower"),
    ("rl_loop", "reward", "higher"),
    ("data_parallel", "loss", "lower"),
])
def test_examples_train_and_two_runs_end_in_bitwise_the_same_state(name: str, metric: str, better: str) -> None:
    compiled = compile_program(example(name).build(steps=12))
    a = ReferenceExecutor(compiled).run()
    b = ReferenceExecutor(compiled).run()
    assert a.state_digest == b.state_digest
    series = [m[metric] for m in a.metrics]
    first, last = np.mean(series[:3]), np.mean(series[-3:])
    assert (last < first) if better == "lower" else (last > first), f"{metric}: {series}"


def test_the_same_exported_programs_give_the_same_bits_on_other_devices_of_the_same_shape() -> None:
    compiled = compile_program(example("data_parallel").build(steps=4))
    on_first = ReferenceExecutor(compiled, devices=jax.devices()[0:4]).run()
    on_last = ReferenceExecutor(compiled, devices=jax.devices()[4:8]).run()
    assert on_first.state_digest == on_last.state_digest


def test_pipeline_runs_each_instance_once_per_step_or_microbatch() -> None:
    mod = example("pipeline_mlp")
    r = run_reference(mod.build(steps=3))
    m = mod.MICROBATCHES
    for stage in range(mod.STAGES):
        assert r.instances[f"update{stage}"] == 3
    for node in ("batch", "fwd0", "fwd2", "loss3", "bwd0"):
        assert r.instances[node] == 3 * m


def test_parameters_reach_the_sampler_only_every_k_steps() -> None:
    mod = example("rl_loop")
    k = mod.SYNC_EVERY
    compiled = compile_program(mod.build(steps=k + 1))
    ex = ReferenceExecutor(compiled)
    # After step 0 the sync ran once (with the initial policy); the trainer moved on.
    after1 = ex.run(steps=1)
    np.testing.assert_array_equal(after1.states["sampler_policy"]["w"], ex.initial_state()["policy"]["w"])
    assert not np.array_equal(after1.states["policy"]["w"], after1.states["sampler_policy"]["w"])
    # The sync at step k copies the trainer's policy as it was at the start of step k.
    before_k = ex.run(steps=k)
    after_k = ex.run(steps=k + 1)
    np.testing.assert_array_equal(after_k.states["sampler_policy"]["w"], before_k.states["policy"]["w"])
    assert after_k.instances["sync"] == 2


def test_digest_covers_every_bit_name_and_shape() -> None:
    base = {"a": {"w": np.zeros((2, 2), np.float32)}, "b": np.arange(3, dtype=np.int32)}
    d = state_digest(base)
    flipped = {"a": {"w": np.zeros((2, 2), np.float32)}, "b": np.arange(3, dtype=np.int32)}
    flipped["a"]["w"].view(np.uint32)[1, 1] ^= 1  # one bit
    assert state_digest(flipped) != d
    assert state_digest({"a": base["a"], "c": base["b"]}) != d  # a state renamed
    assert state_digest({"a": {"w": np.zeros((4,), np.float32)}, "b": base["b"]}) != d  # reshaped
    assert state_digest({"a": {"w": np.zeros((2, 2), np.float64)}, "b": base["b"]}) != d  # other dtype
    assert state_digest(dict(reversed(list(base.items())))) == d  # order of the mapping does not matter


def test_programs_cross_the_wire_as_stablehlo_not_pickle() -> None:
    compiled = compile_program(example("pipeline_mlp").build(steps=1))
    for node in compiled.nodes.values():
        blob = node.exported
        assert isinstance(blob, bytes) and len(blob) > 100
        with pytest.raises(ValueError):
            pickletools.dis(blob, out=io.StringIO())  # not a pickle stream
        exp = jax.export.deserialize(bytearray(blob))
        assert "stablehlo" in exp.mlir_module() or "func.func" in exp.mlir_module()


def test_values_stay_on_the_devices_between_instances_and_the_bits_match_a_run_through_the_host() -> None:
    """Every argument a node is called with (but the step numbers) is a device array laid out as its program
    takes it: no state or output goes through host memory per instance. The final states are host arrays,
    and a run handing its state through the host between steps ends in the same bits."""
    compiled = compile_program(example("pipeline_mlp").build(steps=3))
    ex = ReferenceExecutor(compiled)
    seen: list[tuple[str, str]] = []
    for name, call in list(ex._calls.items()):
        def spy(*args, _call=call, _name=name):  # type: ignore[no-untyped-def]
            seen.extend((_name, type(a).__name__) for a in args
                        if not isinstance(a, jax.Array) and np.asarray(a).shape != ())
            return _call(*args)
        ex._calls[name] = spy
    steps: list[int] = []
    ex.on_step = lambda s, m: steps.append(s)
    whole = ex.run()
    assert seen == [], f"host values handed to nodes: {seen[:5]}"
    assert steps == [0, 1, 2]
    assert all(isinstance(x, np.ndarray) for v in whole.states.values() for x in jax.tree_util.tree_leaves(v))
    state, start = None, 0
    for stop in (1, 3):
        part = ReferenceExecutor(compiled).run(stop, state=state, start_step=start)
        state, start = part.states, stop
    assert part.state_digest == whole.state_digest
    assert part.metrics == whole.metrics[1:]
