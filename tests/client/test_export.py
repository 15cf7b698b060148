"""Weights out without a cluster: a state's tree in Orbax's layout (client/trees.py), a run directory written with
real Orbax saves through the project's own checkpointer, exported (client/weights.py, ``rallypoint export``) and read
back by plain Orbax and by ``load_state``; each bad input refused with one line, nothing written."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from click.testing import CliRunner
from flax import nnx

from rallypoint.basics.errors import RallypointError
from rallypoint.client.commands.main import main
from rallypoint.client.trees import fill, paths, skeleton, skeleton_from_structure, skeleton_of
from rallypoint.client.weights import EXPORT_FILE, load_state
from rallypoint.etcd.commits import CheckpointCommit, commit_record_path
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto.digest import structure
from rallypoint.workers.checkpoints.checkpointer import SliceCheckpointer
from tests.helpers import train_state_job
from tests.helpers.checkpoints import largest_file

RUN = "run-20261206T120000-abcdef"
ROOT = Path(__file__).resolve().parents[2]


class Tiny(nnx.Module):
    def __init__(self) -> None:
        self.layers = nnx.List([nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 2, rngs=nnx.Rngs(1))])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


def _orbax_layout(tree: Any, tmp: Path) -> Any:
    """What plain Orbax makes of ``tree``: its structure as saved and restored without a target."""
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp, jax.tree_util.tree_map(np.asarray, tree))
    with ocp.StandardCheckpointer() as ck:
        return jax.tree_util.tree_structure(ck.restore(tmp))


def test_the_recorded_tree_is_the_layout_plain_orbax_saves_of_the_users_own_tree(tmp_path: Path) -> None:
    def zeros(shapes: Any) -> Any:  # values of the shapes init gives, made without running (or compiling) init
        return jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), shapes)

    trees = {"train_state": zeros(jax.eval_shape(train_state_job.init)),  # Optax NamedTuples, EmptyState, statics
             "nnx": zeros(nnx.to_pure_dict(nnx.state(nnx.eval_shape(Tiny)))),  # int keys of an nnx.List
             "mixed": {"a": (np.ones(2), [np.zeros(()), None]),
                       "b": zeros(jax.eval_shape(optax.adam(0.1).init, {"w": np.ones(3)}))}}
    for name, tree in trees.items():
        treedef = jax.tree_util.tree_structure(tree)
        leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
        rebuilt = fill(skeleton(treedef), leaves)
        assert jax.tree_util.tree_structure(rebuilt) == _orbax_layout(tree, tmp_path / name), name
        assert jax.tree_util.tree_structure(skeleton_of(tree)) == jax.tree_util.tree_structure(rebuilt), name
        # from the structure text alone (a run submitted before the layout was recorded): dicts and lists only
        assert skeleton_from_structure(structure(treedef)) == (skeleton(treedef) if name == "nnx" else None), name
    plain = jax.tree_util.tree_structure({"a": (1, [2, None]), "b": {}, "c)": [{"d": 3}]})
    assert skeleton_from_structure(structure(plain)) == skeleton(plain)
    # a custom node whose key Orbax cannot name: no layout (""), and the submit is not failed for it
    odd = type("Odd", (), {})
    jax.tree_util.register_pytree_with_keys(odd, lambda o: (((object(), 1.0),), None), lambda aux, ch: odd())
    assert skeleton(jax.tree_util.tree_structure({"x": odd()})) == ""
    with pytest.raises(ValueError, match="holds 1 leaves, and there are 2"):
        fill("[0]", [np.ones(1), np.ones(1)])


def _run_dir(root: Path, states: dict[str, tuple[str, Any]], steps: dict[int, float]) -> Path:
    """A run directory as a cluster leaves it: the job spec, each slice's checkpoints saved by the project's own
    checkpointer (real Orbax) at ``steps`` (value: what every leaf is scaled by), and their commit records."""
    rd = root / "job" / RUN
    spec = pb.JobSpec(job="job", steps=max(steps) + 1)
    by_slice: dict[str, dict[str, Any]] = {}
    for name, (slice_name, tree) in states.items():
        treedef = jax.tree_util.tree_structure(tree)
        spec.states.append(pb.StateProgram(name=name, slice=slice_name, leaves=treedef.num_leaves,
                                           tree=skeleton(treedef)))
        by_slice.setdefault(slice_name, {})[name] = tree
    rd.mkdir(parents=True)
    (rd / "jobspec.pb").write_bytes(spec.SerializeToString())
    (rd.parent / "LATEST").write_text(RUN + "\n")

    def record(c: CheckpointCommit) -> None:
        path = commit_record_path(rd, c.slice_name, c.step)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(c.to_json()))

    for slice_name, named in by_slice.items():
        ck = SliceCheckpointer(rd / slice_name, job="job", slice_name=slice_name, max_to_keep=None, commit=record)
        try:
            for step, scale in steps.items():
                ck.save(step, {n: [np.asarray(x) * np.asarray(scale, np.asarray(x).dtype)
                                   for x in jax.tree_util.tree_leaves(t)] for n, t in named.items()})
            ck.wait(timeout_s=60)
        finally:
            ck.close()
    return rd


def _lm_model() -> Any:
    """examples/lm/model.py: the LM example's NNX model."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lm_model_for_export", ROOT / "examples" / "lm" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_export_writes_the_users_tree_as_plain_orbax_and_load_state_reads_it_back(tmp_path: Path) -> None:
    lm = _lm_model()
    cfg = lm.ModelConfig(layers=2, d_model=32, heads=2, context=16)
    # The LM's state: an nnx.State pure dict (its blocks an nnx.List: int keys) and its Optax state, of the shapes
    # init gives, random values (nothing compiles)
    rng = np.random.default_rng(0)
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: lm.Stage(cfg, 0, 2))))
    params = jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), abstract)
    opt = jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape).astype(a.dtype),
                                 jax.eval_shape(lm.optimizer(0.01).init, params))
    rd = _run_dir(tmp_path / "ckpt", {"params": ("s0", params), "opt": ("s1", opt)}, {0: 1.0, 10: 2.0})
    runner = CliRunner()
    out = tmp_path / "out"
    got = runner.invoke(main, ["export", "job", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out)])
    assert got.exit_code == 0, got.output
    assert "at step 10" in got.output
    manifest = json.loads((out / EXPORT_FILE).read_text())
    assert (manifest["step"], manifest["states"], manifest["run"]) == (10, ["opt", "params"], RUN)
    # plain Orbax: the manager; the checkpointer with the user's own abstract tree as its target
    with ocp.CheckpointManager(out, options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
        assert mngr.all_steps() == [10]
        whole = mngr.restore(10, args=ocp.args.StandardRestore())
    want = jax.tree_util.tree_map(lambda x: np.asarray(x) * np.asarray(2, np.asarray(x).dtype), params)
    with ocp.StandardCheckpointer() as ck:
        restored = ck.restore(out / "10" / "default", {"params": abstract, "opt": whole["opt"]})
    assert jax.tree_util.tree_structure(restored["params"]) == jax.tree_util.tree_structure(params)  # int keys back
    for tree in (whole["params"], restored["params"], load_state(out)["params"]):
        assert [(pa, np.asarray(a).tobytes()) for pa, a in paths(tree)] == \
            [(pa, np.asarray(a).tobytes()) for pa, a in paths(want)]
    # into a fresh NNX model (made abstractly: no weights) through nnx.replace_by_pure_dict: the job's weights
    graphdef, state = nnx.split(nnx.eval_shape(lambda: lm.Stage(cfg, 0, 2)))
    nnx.replace_by_pure_dict(state, whole["params"])  # Orbax's string keys "0", "1" of the blocks too
    model = nnx.merge(graphdef, state)
    assert [(pa, np.asarray(a).tobytes()) for pa, a in paths(nnx.to_pure_dict(nnx.state(model)))] == \
        [(pa, np.asarray(a).tobytes()) for pa, a in paths(want)]
    # one state, an older step; straight from the run directory; onto a sharding
    got = runner.invoke(main, ["export", "job", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out),
                               "--step", "0", "--state", "opt", "--force"])
    assert got.exit_code == 0, got.output
    opt = load_state(out)
    assert opt[0] is None and set(opt[1][0]) == {"count", "mu", "nu"}  # chain(clip: EmptyState, adam: ScaleByAdamState)
    direct = load_state(rd, step=0)
    assert sorted(direct) == ["opt", "params"] and np.asarray(direct["opt"][1][0]["count"]).tobytes() == \
        np.asarray(opt[1][0]["count"]).tobytes()
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    on = load_state(out, shardings=dev)
    assert all(isinstance(a, jax.Array) and a.sharding == dev for a in jax.tree_util.tree_leaves(on))


def _refused(args: list[str], *match: str) -> None:
    got = CliRunner().invoke(main, ["export", *args])
    assert got.exit_code == 1, got.output
    lines = [ln for ln in got.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), got.output
    for m in match:
        assert m in lines[0], lines[0]


def test_export_refuses_bad_input_with_one_line_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    rd = _run_dir(root, {"w": ("s0", {"a": np.random.default_rng(0).standard_normal(4096).astype(np.float32)})}, {0: 1.0, 5: 3.0})
    ck = ["--checkpoint-dir", str(root)]
    out = tmp_path / "out"
    _refused(["nojob", *ck, "--out", str(out)], "no run of job 'nojob'")
    _refused(["job", "--run", "run-20200101T000000-000000", *ck, "--out", str(out)], "run-20200101T000000-000000")
    _refused(["job", *ck, "--out", str(out), "--step", "3"], "step 3", "never committed", "0, 5")
    _refused(["job", *ck, "--out", str(out), "--state", "v"], "no state 'v'", "w")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    _refused(["job", *ck, "--out", str(full)], "not empty", "--force")
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    _refused(["job", *ck, "--out", str(full / "keep.txt" / "x")], "cannot be written")
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        if not os.access(locked, os.W_OK):  # root may write anywhere
            _refused(["job", *ck, "--out", str(locked / "x")], "cannot be written")
    finally:
        os.chmod(locked, 0o700)
    # a run submitted before the client recorded the tree: its structure text serves for dicts, lists and tuples;
    # a NamedTuple's fields it does not name: refused, pointing at the flat leaves
    spec = pb.JobSpec.FromString((rd / "jobspec.pb").read_bytes())
    older = pb.JobSpec()
    older.CopyFrom(spec)
    older.states[0].ClearField("tree")
    older.states[0].treedef = structure(jax.tree_util.tree_structure({"a": 0}))
    (rd / "jobspec.pb").write_bytes(older.SerializeToString())
    assert load_state(rd, step=0)["a"].shape == (4096,)
    older.states[0].treedef = structure(jax.tree_util.tree_structure(optax.ScaleByScheduleState(count=0)))
    (rd / "jobspec.pb").write_bytes(older.SerializeToString())
    _refused(["job", *ck, "--out", str(out)], "without the tree of state(s) w", "flat leaves")
    (rd / "jobspec.pb").write_bytes(spec.SerializeToString())
    # an export whose files were changed afterwards: load_state sees it against the export's own checksum
    assert CliRunner().invoke(main, ["export", "job", *ck, "--out", str(tmp_path / "e"), "--step", "0"]).exit_code == 0
    f = largest_file(tmp_path / "e" / "0")
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = b"\x5a" * 64
    f.write_bytes(bytes(raw))
    with pytest.raises(RallypointError, match="does not match its checksum"):
        load_state(tmp_path / "e")
    # a flipped byte in the checkpoint: refused naming the slice and step
    data = largest_file(next((rd / "s0").glob("*/5")))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = b"\x5a" * 64
    data.write_bytes(bytes(raw))
    _refused(["job", *ck, "--out", str(out)], "slice 's0' at step 5", "corrupt")
    assert not out.exists() and not list(tmp_path.glob(".out.export-*"))


def test_a_multi_host_slices_commit_exports_checked_shard_by_shard(tmp_path: Path) -> None:
    """A gang's commit (``sha256-shards:``, its members' digests in ``shards.json``) is read whole in this one
    process and checked against the listing, split as the members held it; a listing that does not match refuses."""
    from rallypoint.workers.checkpoints.checksums import SHARDS_FILE, digest, shard_entries, shards_checksum

    w = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)
    root = tmp_path / "ckpt"
    rd = _run_dir(root, {"params": ("g", {"w": w, "b": np.arange(3, dtype=np.int32)})}, {4: 1.0})
    record = commit_record_path(rd, "g", 4)
    commit = json.loads(record.read_text())
    b = np.arange(3, dtype=np.int32)
    entries = shard_entries([["params", 0, [[0, 3]], "int32", [3], digest(b)],  # leaves in flatten order: b, w
                             ["params", 1, [[0, 4], [0, 4]], "float32", [8, 4], digest(w[0:4])],  # member 0's rows
                             ["params", 1, [[4, 8], [0, 4]], "float32", [8, 4], digest(w[4:8])]])  # member 1's
    (Path(commit["path"]) / SHARDS_FILE).write_text(json.dumps(entries))
    record.write_text(json.dumps(commit | {"checksum": shards_checksum(entries)}))
    got = load_state(rd)
    assert got["w"].tobytes() == w.tobytes() and got["b"].tobytes() == b.tobytes()
    # exported, then read by Orbax straight onto a tree of shardings: w's rows over 4 devices, b on one
    assert CliRunner().invoke(main, ["export", "job", "--checkpoint-dir", str(root), "--out",
                                     str(tmp_path / "x")]).exit_code == 0
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    on = load_state(tmp_path / "x", shardings={"w": rows, "b": one})
    assert on["w"].sharding == rows and [s.data.shape for s in on["w"].addressable_shards] == [(2, 4)] * 4
    assert np.asarray(on["w"]).tobytes() == w.tobytes() and on["b"].sharding == one
    with pytest.raises(RallypointError, match="no sharding for leaf b"):
        load_state(tmp_path / "x", shardings={"w": rows})
    entries[1]["sha256"] = digest(w[0:4] + 1)  # a member's digest that is not of what was saved
    record.write_text(json.dumps(commit | {"checksum": shards_checksum(entries)}))
    (Path(commit["path"]) / SHARDS_FILE).write_text(json.dumps(entries))
    _refused(["job", "--checkpoint-dir", str(root), "--out", str(tmp_path / "out")], "slice 'g' at step 4",
             "corrupt", "sha256-shards:")
    assert not (tmp_path / "out").exists()
