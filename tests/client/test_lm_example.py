"""The LM example (examples/lm) at tiny sizes in the in-process reference: it learns, both layouts agree."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rallypoint.client.jobfile import load_program
from rallypoint.client.program import ProgramError
from rallypoint.client.reference import run_reference
from tests.helpers.lm import TINY, TRAIN


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for k, v in TINY.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LM_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def losses(variant: str, steps: int, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    monkeypatch.setenv("LM_VARIANT", variant)
    if variant == "dp":
        monkeypatch.setenv("LM_EVAL_EVERY", "5")
    result = run_reference(load_program(TRAIN, steps=steps))
    assert all(m["tokens"] == 8 * 16 for m in result.metrics)  # LM_BATCH x LM_CONTEXT targets a step
    if variant == "dp":  # an eval_loss every LM_EVAL_EVERY steps, of the weights at the step's start
        assert [s for s, m in enumerate(result.metrics) if "eval_loss" in m] == list(range(0, steps, 5))
        assert abs(result.metrics[0]["eval_loss"] - math.log(256)) < 0.1 and \
            result.metrics[5]["eval_loss"] < result.metrics[0]["eval_loss"] - 0.5
    return [m["loss"] for m in result.metrics]


def test_the_lm_learns_and_both_layouts_start_from_the_same_loss(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dp = losses("dp", 8, monkeypatch)
    assert all(math.isfinite(x) for x in dp)
    assert abs(dp[0] - math.log(256)) < 0.1  # a near-uniform guess over bytes at first
    assert max(dp[-3:]) < dp[0] - 1.0, dp  # and clearly better after 8 steps

    # The token file was prepared on first use, from the standard library's source.
    token_file = next(tiny.glob("stdlib-py*-65536.npy"))
    manifest = json.loads(token_file.with_suffix(".json").read_text())
    assert manifest["bytes"] == 65536 and manifest["files"] >= 1
    assert np.load(token_file, mmap_mode="r").dtype == np.uint8

    # Same init (each piece from its own key), same examples per step (positions [s*B, (s+1)*B), cut into
    # microbatches in order): the pipeline's first loss equals the data-parallel one up to rounding, and
    # the runs stay together while Adam's steps are the same.
    pipe = losses("pipeline", 3, monkeypatch)
    assert pipe[0] == pytest.approx(dp[0], rel=1e-5)
    assert pipe[1:] == pytest.approx(dp[1:3], rel=1e-3)


def test_prepare_is_idempotent(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("lm_prepare_test", TRAIN.parent / "prepare.py")
    assert spec and spec.loader
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    path = prepare.prepare(tmp_path, 4096)
    stamp = path.stat().st_mtime_ns
    assert prepare.prepare(tmp_path, 4096) == path and path.stat().st_mtime_ns == stamp
    assert bytes(np.load(path)) == prepare.corpus_bytes(4096)[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.with_suffix(".json").name, path.name]  # no temp left


@pytest.mark.parametrize(("env", "message"), [
    ({"LM_VARIANT": "tensor"}, "LM_VARIANT must be one of dp, fsdp, tp, pipeline"),
    ({"LM_BATCH": "6", "LM_DEVICES": "4"}, "LM_BATCH 6 must split"),
    ({"LM_VARIANT": "pipeline", "LM_BATCH": "6"}, "LM_BATCH 6 must split"),
    ({"LM_VARIANT": "tp", "LM_DEVICES": "4", "LM_TENSOR": "3"}, "LM_TENSOR 3 must divide"),
    ({"LM_VARIANT": "tp", "LM_DEVICES": "4", "LM_BATCH": "3"}, "LM_BATCH 3 must split"),
])
def test_a_bad_setting_names_its_variable(env: dict[str, str], message: str, tiny: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ProgramError, match=message):
        load_program(TRAIN)


def test_the_benchmarks_plain_loop_trains_like_the_reference(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/lm.py's plain jitted loop runs the same step on the same data as the program."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_lm_test", TRAIN.parents[2] / "bench" / "lm.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    program = bench.lm_program(3, "dp")
    plain = bench.plain_loop(program, 3)
    assert plain["tokens"] == 8 * 16 and len(plain["source_s"]) == 3 and len(plain["times"]) == 3
    reference = [m["loss"] for m in run_reference(program).metrics]
    assert plain["losses"] == pytest.approx(reference, rel=1e-4)
    assert plain["losses"][2] < plain["losses"][0]
