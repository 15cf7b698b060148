"""The state digest means the same in every process: a ``TrainState`` job's reference run made in two
processes, and its run on a real cluster (the coordinator's digest), all agree. The same run's newest committed
state, exported by ``rallypoint export``, is restored by plain Orbax in a process that imports no Rallypoint, bitwise
the reference's state at that step, as the job's own tree in Orbax's layout."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from rallypoint.client.commands.main import main
from rallypoint.client.compile import compile_program
from rallypoint.client.reference import run_reference
from rallypoint.client.trees import paths, skeleton_of
from rallypoint.client.submission import submit
from rallypoint.cluster.local import LocalCluster
from tests.helpers import train_state_job
from tests.helpers.cli import ROOT


def _reference_in_a_new_process() -> str:
    out = subprocess.run([sys.executable, "-m", "tests.helpers.train_state_job"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_a_train_state_jobs_reference_digest_is_the_same_in_two_processes_and_on_the_cluster(
    local_cluster: Callable[..., LocalCluster], tmp_path: Path,
) -> None:
    first, second = _reference_in_a_new_process(), _reference_in_a_new_process()
    assert first == second and len(first) == 64
    lc = local_cluster(workers=1, spares=0, coordinators=1)
    events: list[dict] = []
    result = submit(compile_program(train_state_job.build()), endpoints=lc.endpoints, cluster=lc.keys.cluster,
                    on_event=lambda ev: events.append({"event": ev.event, **json.loads(ev.detail or "{}")}))
    coordinator = next(e["state_digest"] for e in events if e["event"] == "job.finished")
    assert result.state_digest == coordinator == first

    _export_restores_with_plain_orbax_bitwise(lc, tmp_path / "weights")


# Run in a process of its own: Orbax, JAX and NumPy only. Prints each leaf's path, dtype, shape and sha256.
RESTORE_WITH_ORBAX_ALONE = """
import hashlib, json, sys
import jax, numpy as np, orbax.checkpoint as ocp
with ocp.CheckpointManager(sys.argv[1], options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
    step = mngr.latest_step()
    tree = mngr.restore(step, args=ocp.args.StandardRestore())
assert not any(m.split(".")[0] == "rallypoint" for m in sys.modules), "rallypoint was imported"
leaves = {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p):
          [a.dtype.name, list(a.shape), hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()]
          for p, a in jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_map(np.asarray, tree))[0]}
print(json.dumps({"step": step, "leaves": leaves}))
"""


def _export_restores_with_plain_orbax_bitwise(lc: LocalCluster, out: Path) -> None:
    got = CliRunner().invoke(main, ["export", "train-state", "--checkpoint-dir", str(lc.checkpoint_dir),
                                    "--out", str(out), "--json"])
    assert got.exit_code == 0, got.output
    step = json.loads(got.output.strip().splitlines()[-1])["step"]
    assert step >= 2  # the newest cut: 2 (every 2 of 4 steps), or the final 4 once every job commits its final state
    with subprocess.Popen([sys.executable, "-c", RESTORE_WITH_ORBAX_ALONE, str(out)], cwd=out.parent,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as restoring:
        want = skeleton_of(run_reference(train_state_job.build(steps=step)).states["state"])  # meanwhile
        stdout, stderr = restoring.communicate(timeout=120)
    assert restoring.returncode == 0, stderr[-2000:]
    read = json.loads(stdout.strip().splitlines()[-1])
    assert read["step"] == step
    assert read["leaves"] == {"/".join(map(str, p)): [np.asarray(a).dtype.name, list(np.shape(a)),
                                                      hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()]
                              for p, a in paths(want)}
    assert {"step", "params/w", "opt_state/1/0/mu/w"} <= set(read["leaves"])  # the TrainState's own tree
