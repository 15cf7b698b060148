"""A trained model comes out and a pretrained one goes in, as a user does it from the command line.

The LM example (examples/lm, tiny, evaluating every 4 steps on a fixed batch) runs on the embedded
cluster (`rallypoint run`) through a SIGKILL of its worker, writing TensorBoard files. Then:

* `rallypoint export` writes its weights at the last evaluation's step as a plain Orbax checkpoint;
  a Python process that never imports Rallypoint restores them with Orbax into a fresh Flax NNX
  model and gets, on the evaluation batch, the job's own `eval_loss` at that step;
* a second job warm-starts from that export (`LM_INIT_FROM`, the example's `init_from=`; run in process,
  the same exported programs): its first evaluation, of the weights it started from, is bitwise the first
  job's evaluation at that step;
* the first run's TensorBoard files hold every step's loss once, the evaluations at their steps and
  the recovery's marks; the run's own directory holds the final cut, which `export` takes by default.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.cli import ROOT, rp
from tests.helpers.lm import TINY

STEPS, EVAL_EVERY, EVERY, KILL_AT = 12, 4, 4, 6
LAST_EVAL = (STEPS - 1) // EVAL_EVERY * EVAL_EVERY  # 8: the weights as they stood at the start of step 8

RESTORE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx
    sys.path.insert(0, sys.argv[1])
    import model as lm  # the example's model: Flax NNX, no Rallypoint
    cfg = lm.ModelConfig(**json.loads(sys.argv[2]))
    with ocp.CheckpointManager(sys.argv[3], options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
        weights = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore())
    graphdef, state = nnx.split(lm.Stage(cfg, 0, cfg.layers))  # a fresh model, its own random weights
    nnx.replace_by_pure_dict(state, weights)
    model = nnx.merge(graphdef, state)
    batch = np.load(sys.argv[4])
    loss = float(lm.cross_entropy(model(batch["inputs"]), batch["targets"]))
    assert not any(m.startswith("rallypoint") for m in sys.modules), "the restore must not need Rallypoint"
    print(json.dumps({"loss": loss, "step": mngr.latest_step()}))
""")


def events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_an_lm_trained_through_a_kill_is_exported_restored_by_plain_orbax_and_warm_starts_a_second_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = {**TINY, "LM_DATA_DIR": str(tmp_path / "lm-data"), "LM_EVAL_EVERY": str(EVAL_EVERY)}
    env = {**settings, "RALLYPOINT_STATE_DIR": str(tmp_path / "state")}
    board = tmp_path / "tb"
    job = "examples/lm/train.py"
    first = events(rp("run", job, "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--json",
                      "--fail", f"kill:dp@{KILL_AT}", "--tensorboard", str(board), timeout=400, env=env).stdout)
    finished = first[-1]
    assert finished["event"] == "job.finished" and finished["recoveries"], finished
    evals = {e["step"]: e["metrics"]["eval_loss"] for e in first if e["event"] == "step" and "eval_loss" in e["metrics"]}
    assert sorted(evals) == list(range(0, STEPS, EVAL_EVERY)), evals

    # Weights out: the last evaluation's step, restored by Orbax alone into a fresh NNX model.
    weights = tmp_path / "weights"
    rp("export", "lm-dp", "--step", str(LAST_EVAL), "--state", "params", "--out", str(weights), env=env)
    for k, v in settings.items():  # the example's eval batch, as its host source reads it
        monkeypatch.setenv(k, v)
    from rallypoint.client.jobfile import load_program

    program = load_program(ROOT / job)
    np.savez(tmp_path / "eval.npz", **program.nodes["eval_batch"].fn(LAST_EVAL, 0))
    model_cfg = {"layers": 2, "d_model": int(TINY["LM_D_MODEL"]), "heads": int(TINY["LM_HEADS"]),
                 "context": int(TINY["LM_CONTEXT"]), "seed": 0}
    restored = subprocess.run([sys.executable, "-c", RESTORE, str(ROOT / "examples" / "lm"), json.dumps(model_cfg),
                               str(weights), str(tmp_path / "eval.npz")], capture_output=True, text=True, timeout=120)
    assert restored.returncode == 0, restored.stderr[-3000:]
    got = json.loads(restored.stdout.splitlines()[-1])
    assert got["step"] == LAST_EVAL
    # One device here, the job's two there (the mean's reduction order differs): equal to float32's last bits.
    assert got["loss"] == pytest.approx(evals[LAST_EVAL], rel=1e-5, abs=1e-6), (got, evals)

    # Weights in: a second job starts from the export; its first evaluation is of exactly those weights (in
    # process, the same exported programs: tests/integration/test_init_from.py starts one on a cluster).
    second = events(rp("run", job, "--steps", "1", "--json", "--reference", timeout=300,
                       env={**env, "LM_INIT_FROM": str(weights)}).stdout)
    (warm,) = [e["metrics"]["eval_loss"] for e in second if e["event"] == "step" and e["step"] == 0]
    assert warm == evals[LAST_EVAL], (warm, evals[LAST_EVAL])

    # The first run's final cut, the export's default, and its TensorBoard files.
    final = tmp_path / "final"
    rp("export", "lm-dp", "--run", first_run(tmp_path), "--out", str(final), env=env)
    assert json.loads((final / "rallypoint-export.json").read_text())["step"] == STEPS
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_board,) = (board / "lm-dp").iterdir()
    acc = EventAccumulator(str(run_board), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == list(range(STEPS))  # every step once, the replayed ones too
    assert [e.step for e in acc.Scalars("eval_loss")] == sorted(evals)
    assert [e.value for e in acc.Scalars("rallypoint/lost_workers")] == [1.0]
    assert len(acc.Scalars("rallypoint/recovery_mttr_s")) == 1


def first_run(tmp_path: Path) -> str:
    """The first job's run id: the oldest run of lm-dp kept under the state directory."""
    runs = sorted(p.name for p in (tmp_path / "state" / "runs" / "lm-dp").iterdir() if p.name.startswith("run-"))
    return runs[0]
