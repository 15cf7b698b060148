"""The LM example's sharded variants (examples/lm): FSDP and tensor parallelism, as compiled and as born.

No processes: the layouts the compiled states carry (``CompiledState.specs``), Adam's moments laid
out as the weights they follow, and the exported ``init`` run on 4 CPU devices of this process,
where each device holds about a quarter of the FSDP state against all of the replicated one.
"""

from __future__ import annotations

from typing import Any

import jax
import pytest
from jax.sharding import PartitionSpec as P

from rallypoint.client.compile import CompiledProgram, compile_program, slice_mesh
from rallypoint.client.jobfile import load_program
from rallypoint.workers.programs import load_exported
from tests.helpers.lm import TRAIN, tiny_lm
from tests.helpers.sharding import per_device_bytes


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CompiledProgram]:
    """The tiny LM of 4 devices compiled in each one-slice variant (once for the module)."""
    data_dir = tmp_path_factory.mktemp("lm-data")
    out = {}
    for variant in ("dp", "fsdp", "tp"):
        with pytest.MonkeyPatch.context() as mp:
            tiny_lm(mp, data_dir, variant=variant, devices="4")
            out[variant] = compile_program(load_program(TRAIN, steps=2))
    return out


def specs_by_path(compiled: CompiledProgram, state: str) -> dict[str, P]:
    st = compiled.states[state]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(st.aval)[0]]
    return dict(zip(paths, st.specs, strict=True))


def adam_moments(compiled: CompiledProgram) -> dict[str, dict[str, P]]:
    """``mu`` and ``nu`` of ``optax.chain(clip, adam)``'s state: each weight's path -> its spec."""
    out: dict[str, dict[str, P]] = {"mu": {}, "nu": {}}
    for path, spec in specs_by_path(compiled, "opt_state").items():
        for moment in out:
            if f".{moment}[" in path:
                out[moment][path.split(f".{moment}", 1)[1]] = spec
    return out


def state_bytes(compiled: CompiledProgram) -> tuple[int, dict[Any, int]]:
    """The states' total bytes, and each device's bytes, from the exported inits run on the slice's mesh."""
    leaves = [leaf for st in compiled.states.values()
              for leaf in load_exported(st.exported_init, slice_mesh(compiled.program, st.slice))()]
    return sum(int(leaf.nbytes) for leaf in leaves), per_device_bytes(leaves)


def test_fsdp_splits_every_weight_and_adam_moment_over_data_along_its_largest_dimension(
    lm: dict[str, CompiledProgram],
) -> None:
    compiled = lm["fsdp"]
    params = specs_by_path(compiled, "params")
    assert params["['tok']['embedding']"] == P("data")  # (256, 32): the vocabulary
    assert params["['pos']"] == P(None, "data")  # (16, 32): d_model
    assert params["['blocks'][0]['up']['kernel']"] == P(None, "data")  # (32, 128)
    assert params["['blocks'][0]['down']['kernel']"] == P("data")  # (128, 32)
    assert params["['blocks'][0]['attn']['query']['kernel']"] == P("data")  # (32, 2, 16): the first of equals
    assert params["['blocks'][0]['attn']['query']['bias']"] == P(None, "data")  # (2, 16): 2 heads do not divide
    assert params["['blocks'][1]['ln1']['scale']"] == P("data")
    assert all(s != P() for s in params.values())
    moments = adam_moments(compiled)
    assert moments["mu"] == params and moments["nu"] == params  # each moment as the weight it follows
    counts = [s for p, s in specs_by_path(compiled, "opt_state").items() if p.endswith(".count")]
    assert counts and all(s == P() for s in counts)  # the step counts: scalars, replicated
    assert compiled.states["params"].variants.keys() == {2}  # also exported for the shrunk slice


def test_tp_splits_the_mlp_and_the_heads_over_model_and_the_rest_over_data(lm: dict[str, CompiledProgram]) -> None:
    compiled = lm["tp"]
    sl = compiled.program.slices["tp"]
    assert (sl.mesh_axes, sl.mesh_shape, sl.device_counts()) == (("data", "model"), (2, 2), (4, 2))
    params = specs_by_path(compiled, "params")
    for i in (0, 1):
        b = f"['blocks'][{i}]"
        assert params[f"{b}['up']['kernel']"] == P(None, "model")
        assert params[f"{b}['up']['bias']"] == P("model")
        assert params[f"{b}['down']['kernel']"] == P("model", None)
        assert params[f"{b}['down']['bias']"] == P("data")  # (32,): FSDP where it divides
        for qkv in ("query", "key", "value"):
            assert params[f"{b}['attn']['{qkv}']['kernel']"] == P(None, "model", None)
            assert params[f"{b}['attn']['{qkv}']['bias']"] == P("model", None)
        assert params[f"{b}['attn']['out']['kernel']"] == P("model", None, None)
        assert params[f"{b}['attn']['out']['bias']"] == P("data")
    assert params["['tok']['embedding']"] == P("data") and params["['head']['kernel']"] == P(None, "data")
    moments = adam_moments(compiled)
    assert moments["mu"] == params and moments["nu"] == params


def test_the_fsdp_state_is_born_sharded_a_quarter_per_device_against_all_of_it_replicated(
    lm: dict[str, CompiledProgram],
) -> None:
    total, dp = state_bytes(lm["dp"])
    assert len(dp) == 4 and all(b == total for b in dp.values())  # every device holds all of it
    fsdp_total, fsdp = state_bytes(lm["fsdp"])
    assert fsdp_total == total and len(fsdp) == 4
    scalars = 4  # Adam's step count (int32), replicated: nothing else is
    assert all(b == (total - scalars) // 4 + scalars for b in fsdp.values()), (total, fsdp)
    # tp on (2, 2): every leaf but the count is split in two, over "model" or over "data"
    tp_total, tp = state_bytes(lm["tp"])
    assert tp_total == total and all(b == (total - scalars) // 2 + scalars for b in tp.values()), (total, tp)
