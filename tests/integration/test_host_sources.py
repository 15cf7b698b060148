"""Host sources on a real local cluster: the job's Python reads a file on the workers.

A data-parallel job whose batches come from a host source (``prog.source(..., host=True)``)
reading a NumPy file outside its code bundle, as a real job reads its corpus from the
filesystem every worker mounts. On real worker processes, with real SIGKILLs:

* a kill ends bitwise equal to the in-process reference, and every replayed batch read
  the same bytes (one checksum per instance in ``<run>/sources/batch.jsonl``);
* after a kill with no spare of 4 devices the slice shrinks onto 2 and reads the same
  examples (the same checksums), ending within the reshard tolerance;
* a source that raises fails the job with the user's traceback and the step, and no
  worker is fenced;
* a source that is not deterministic (it draws from an unseeded generator) is caught
  when the kill replays it, and the job fails naming the source and the step;
* the source's ``y`` is float64 (NumPy's default) and JAX runs without x64: it is converted
  to float32 once, alike in the reference and on the workers, so the runs still agree bitwise;
* the user's own train step (``Program.from_step``, examples/flax_step.py: Flax NNX and
  Optax, its data a host source, its step asking for ``rng``, an evaluation every 5 steps)
  survives a kill bitwise;
* so does the LM example (examples/lm, tiny), its loss falling.
"""

from __future__ import annotations

import hashlib
import json
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from rallypoint.client.compile import compile_program
from rallypoint.client.commands.faults import Fault
from rallypoint.client.jobfile import load_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.submission import JobError
from rallypoint.cluster.local import LocalCluster
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.orchestrator.control.devices import DeviceLeases
from rallypoint.proto.digest import RESHARD_TOLERANCE, states_close
from tests.examples import example
from tests.helpers.cluster import run

pytestmark = pytest.mark.processes

LM_TRAIN = Path(__file__).resolve().parents[2] / "examples" / "lm" / "train.py"
TINY_LM = {"LM_D_MODEL": "32", "LM_HEADS": "2", "LM_CONTEXT": "16", "LM_BATCH": "8", "LM_LR": "0.01",
           "LM_CORPUS_BYTES": "65536", "LM_DEVICES": "2", "LM_VARIANT": "dp", "LM_EVAL_EVERY": "0"}

STEPS = 16
JOB = '''
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from rallypoint.client import Program, gather

DATA = {data!r}  # outside the code bundle: the filesystem every worker mounts
MODE = {mode!r}
ROWS = 8


def read_batch(step, microbatch):
    table = np.load(DATA, mmap_mode="r")
    start = ((step * 2 + microbatch) * ROWS) % (len(table) - ROWS)
    x = np.array(table[start:start + ROWS], dtype=np.float32)
    if MODE == "raise" and step == 5:
        raise ValueError(f"record {{start}} is corrupt")
    if MODE == "random":
        x = x + np.random.default_rng().normal(size=x.shape).astype(np.float32)
    return {{"x": x, "y": x.sum(axis=1, keepdims=True, dtype=np.float64) * 0.5}}  # y: NumPy's default float64


def grads(w, x, y):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return {{"g": g, "loss": loss}}


prog = Program({name!r}, steps={steps}, microbatches=2, checkpoint_every=4)
dp = prog.slice("dp", devices=(2, 4), mesh_axes=("data",))
w = prog.state("w", slice=dp, init=lambda: jnp.zeros((4, 1), jnp.float32))
batch = prog.source("batch", read_batch, slice=dp, outputs=("x", "y"), host=True,
                    shardings={{"x": P("data"), "y": P("data")}})
g = prog.node("grads", grads, slice=dp, per="microbatch", inputs={{"w": w, "x": batch["x"], "y": batch["y"]}},
              outputs=("g", "loss"), shardings={{"x": P("data"), "y": P("data")}})
prog.node("sgd", lambda w, g: {{"w": w - 0.01 * g.mean(axis=0)}}, slice=dp, inputs={{"w": w, "g": gather(g["g"])}},
          outputs=("w",), updates={{"w": w}})
prog.metric("loss", g["loss"])
program = prog
'''


def job(tmp_path: Path, name: str, mode: str) -> Any:
    data = tmp_path / "data" / "table.npy"
    if not data.exists():
        data.parent.mkdir(parents=True)
        np.save(data, np.random.default_rng(0).normal(size=(200, 4)).astype(np.float32))
    code = tmp_path / f"code-{name}"
    code.mkdir()
    (code / "job.py").write_text(textwrap.dedent(JOB).format(data=str(data), mode=mode, name=name, steps=STEPS))
    return compile_program(load_program(code / "job.py"))


def ledger(lc: LocalCluster, job_name: str) -> dict[tuple[int, int], set[str]]:
    (path,) = Path(lc.config.state_dir).rglob(f"{job_name}/*/sources/batch.jsonl")
    sums: dict[tuple[int, int], set[str]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        sums.setdefault((r["s"], r["m"]), set()).add(r["h"])
    return sums


def record(lc: LocalCluster, job_name: str) -> dict[str, Any]:
    store = lc.store()
    try:
        return json.loads(store.get(lc.keys.job(job_name)).value)
    finally:
        store.close()


def alive(lc: LocalCluster) -> dict[str, int]:
    store = lc.store()
    try:
        return {w: s.info.incarnation for w, s in read_cluster(store, lc.keys).workers.items()}
    finally:
        store.close()


def leaves(result: Any) -> dict[str, list[np.ndarray]]:
    return {n: [np.asarray(x) for x in jax.tree_util.tree_leaves(v)] for n, v in result.states.items()}


def test_a_host_source_reads_a_file_on_the_workers_through_a_kill_a_shrink_a_raise_and_a_nondeterministic_replay(
    local_cluster: Callable[..., LocalCluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in {**TINY_LM, "LM_DATA_DIR": str(tmp_path / "lm-data")}.items():  # the workers see them too
        monkeypatch.setenv(k, v)
    lc = local_cluster(workers=1, spares=5, devices_per_worker=4, coordinators=1)  # each kill takes one

    # A kill: the slice moves to a spare of 4 devices, replays from the cut, reads the same bytes.
    killed = job(tmp_path, "hs-kill", "file")
    reference = ReferenceExecutor(killed).run()
    result, injector = run(lc, killed, [Fault("dp", "dp", 9)], checkpoint_every=4)
    assert result.state_digest == reference.state_digest
    assert result.recovery["replayed_instances"].get("batch", 0) > 0, result.recovery
    (bundle,) = Path(lc.config.state_dir).rglob("hs-kill/*/code/*.zip")  # the code the run used, by its hash
    assert hashlib.sha256(bundle.read_bytes()).hexdigest() == bundle.stem == record(lc, "hs-kill")["code_sha256"]
    sums = ledger(lc, "hs-kill")
    assert set(sums) == {(s, m) for s in range(STEPS) for m in range(2)}
    assert all(len(h) == 1 for h in sums.values()), sums

    # A source that raises: the job fails with the user's traceback and the step; no worker is fenced.
    before = alive(lc)
    with pytest.raises(JobError) as failed:
        run(lc, job(tmp_path, "hs-raise", "raise"), [], checkpoint_every=4)
    text = str(failed.value)
    assert "host source 'batch'" in text and "raised at step 5" in text, text
    assert "ValueError: record" in text and "is corrupt" in text and "Traceback" in text, text
    assert alive(lc) == before

    # Not deterministic: the replay after the kill reads other bytes than the first run did.
    with pytest.raises(JobError) as failed:
        run(lc, job(tmp_path, "hs-random", "random"), [Fault("dp", "dp", 9)], checkpoint_every=4)
    text = str(failed.value)
    replayed = re.search(r"read different bytes at step (\d+) than when it first ran", text)
    assert "host source 'batch'" in text and replayed and int(replayed.group(1)) <= 9, text
    assert "deterministic function of (step, microbatch)" in text, text

    # A shrink: with no spare of 4 devices left, the slice goes onto 2 devices and reads the same examples.
    up = sorted(alive(lc))
    assert len(up) == 4, up
    store = lc.store()
    leases = DeviceLeases(store, lc.keys)
    try:
        assert leases.lease("blocker", "b", up[1], [0, 1]) is not None  # up[1]: 2 of its 4 devices free
        for other in up[2:]:  # the others: none free
            assert leases.lease(f"other-{other}", "b", other, [0, 1, 2, 3]) is not None
        shrunk = job(tmp_path, "hs-shrink", "file")
        result, injector = run(lc, shrunk, [Fault("dp", "dp", 9)], checkpoint_every=4, on_no_spare="shrink")
    finally:
        leases.release("blocker")
        for other in up[2:]:
            leases.release(f"other-{other}")
        store.close()
    assert injector.fired[0]["worker"] == up[0]
    (change,) = result.recovery["resharded"]
    assert (change["from"], change["to"]) == (4, 2)
    assert ledger(lc, "hs-shrink") == sums  # the same examples, bytes for bytes, as the first job read
    ok, evidence = states_close(leaves(result), leaves(ReferenceExecutor(shrunk).run()), **RESHARD_TOLERANCE)
    assert ok, evidence

    # The user's own train step (Program.from_step, a Flax NNX model, a host source): a kill, bitwise.
    own = compile_program(example("flax_step").build(steps=20))
    result, injector = run(lc, own, [Fault("main", "main", 12)], checkpoint_every=5)
    assert injector.fired and result.recovery["recoveries"], result.recovery
    assert result.state_digest == ReferenceExecutor(own).run().state_digest

    # The LM example (a Flax NNX GPT reading the standard library's source through Grain), tiny: a kill, bitwise,
    # the loss falling. LM_DATA_SEED is a setting given at submit (`--set`): the workers, started without it, read
    # the examples of the shipped seed (with their own default, 0, the digest would differ from the reference's).
    lm = compile_program(load_program(LM_TRAIN, steps=16, settings={"LM_DATA_SEED": "1"}))
    result, injector = run(lc, lm, [Fault("dp", "dp", 11)], checkpoint_every=5)
    assert injector.fired and result.recovery["recoveries"], result.recovery
    assert result.state_digest == ReferenceExecutor(lm).run().state_digest
    loss = [m["loss"] for m in result.metrics]
    assert abs(loss[0] - np.log(256)) < 0.1 and max(loss[-3:]) < loss[0] - 1.0, loss
