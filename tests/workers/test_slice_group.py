"""A multi-host slice's JAX distributed group: real member processes joined by jax.distributed (gloo on CPU).

One group of 2 members x 2 CPU devices per test that needs one; the tests drive the same
exported train step that a slice would run, over the group's global 4-device mesh."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.workers.checkpoints.restore import restore_commit
from rallypoint.workers.errors import CheckpointCorrupt
from rallypoint.workers.checkpoints.checksums import SHARDED, read_listing
from rallypoint.workers.gang.lead import GangSlice, GroupSharding, GroupValue
from rallypoint.workers.gang.checkpoint import GangSteps, restore_on_gang
from rallypoint.workers.programs import load_exported
from rallypoint.workers.gang.group import GroupError, GroupLost, SliceGroup
from tests.conftest import wait_until

pytestmark = pytest.mark.processes

STEPS = 6
BATCH, WIDTH = 16, 8


def _train_step_bytes() -> bytes:
    """A step over a 4-device mesh: the batch sharded across devices, the weights replicated, so the
    gradient is an all-reduce across both members."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    data, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

    def step(w: jax.Array, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        def loss(w: jax.Array) -> jax.Array:
            return jnp.mean((jnp.tanh(x @ w) - y) ** 2)
        value, grad = jax.value_and_grad(loss)(w)
        return w - 0.5 * grad, value

    f = jax.jit(step, in_shardings=(rep, data, data), out_shardings=(rep, rep))
    avals = (jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32, sharding=rep),
             jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32, sharding=data),
             jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32, sharding=data))
    return bytes(jax.export.export(f)(*avals).serialize())


TEACHER = np.random.default_rng(7).standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.5


def _batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(step).standard_normal((BATCH, WIDTH)).astype(np.float32)
    return x, np.tanh(x @ TEACHER).astype(np.float32)


W0 = np.random.default_rng(99).standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.3


def _setup(group: SliceGroup, program: bytes) -> None:
    group.mesh("m", [4], ["d"])
    group.load("step", program, "m")


def _run(group: SliceGroup, start: int, stop: int, losses: list[float]) -> None:
    for s in range(start, stop):
        x, y = _batch(s)
        group.put("x", x, "m", ["d"])
        group.put("y", y, "m", ["d"])
        group.call("step", ["w", "x", "y"], ["w", "loss"])
        losses.append(float(group.fetch("loss")))


@pytest.fixture(scope="module")
def program() -> bytes:
    return _train_step_bytes()


@pytest.fixture
def group() -> Iterator[SliceGroup]:
    g = SliceGroup.form(2, 2, request_timeout_s=30.0, heartbeat_s=30)
    yield g
    g.abort()


def _gone(pids: list[int], within_s: float) -> bool:
    """Whether every process of ``pids`` has ended within ``within_s`` (fails naming them otherwise)."""

    def ended(p: int) -> bool:
        try:
            os.kill(p, 0)
        except ProcessLookupError:
            return True
        return False

    return bool(wait_until(lambda: all(ended(p) for p in pids), within_s, f"processes {pids} to end"))


def test_a_group_forms_runs_the_exported_step_shard_by_shard_and_a_restored_group_ends_bitwise_equal(
    program: bytes, group: SliceGroup, tmp_path: Path,
) -> None:
    # Formed: one set of 4 global devices, 2 local to each member, process ids in the gang's order.
    assert [m.ready["process"] for m in group.members] == [0, 1]
    assert all(m.ready["devices"] == 4 and len(m.ready["local"]) == 2 for m in group.members)
    _setup(group, program)
    # Shard by shard: each member is sent only its half of the batch and holds only its half.
    x, _ = _batch(0)
    assert group.put("probe", x, "m", ["d"]) == [x.nbytes // 2, x.nbytes // 2]
    held, _, _ = group.shards("probe")
    assert [[ix for ix, _ in m] for m in held] == [[[[0, 4], [0, 8]], [[4, 8], [0, 8]]],
                                                   [[[8, 12], [0, 8]], [[12, 16], [0, 8]]]]
    assert np.array_equal(group.fetch("probe"), x)
    _checkpoint_of_a_sharded_value(group, x, tmp_path / "ck")
    group.free(["probe"])
    # The uninterrupted run, with a multi-process Orbax save of the state at step 3.
    group.put("w", W0, "m", [])
    losses: list[float] = []
    _run(group, 0, 3, losses)
    saved = group.save(str(tmp_path / "cut3"), {"w": ["w"]})
    assert [e[:5] for e in saved] == [["w", 0, [[0, WIDTH], [0, WIDTH]], "float32", [WIDTH, WIDTH]]], saved
    _run(group, 3, STEPS, losses)
    final = group.fetch("w")
    assert losses[-1] < losses[0], losses
    # The same step in one process over 4 devices agrees (the reduction crosses processes through gloo).
    w = W0
    f = load_exported(program, Mesh(np.array(jax.devices()[:4]), ("d",)))
    for s in range(STEPS):
        w, _ = f(w, *_batch(s))
    np.testing.assert_allclose(np.asarray(w), final, rtol=1e-5, atol=1e-6)
    # A new group restores the cut, each member reading its own shards, and replays: bitwise the same state.
    group.close()
    again = SliceGroup.form(2, 2, request_timeout_s=30.0, heartbeat_s=30)
    try:
        _setup(again, program)
        got = again.restore(str(tmp_path / "cut3"), {"w": [{"value": "w", "mesh": "m", "spec": [],
                                                            "shape": [WIDTH, WIDTH], "dtype": "float32"}]})
        assert got == saved  # the same bytes read back (each shard's digest)
        replayed: list[float] = []
        _run(again, 3, STEPS, replayed)
        assert replayed == losses[3:]
        assert np.array_equal(again.fetch("w"), final)
    finally:
        again.close()


def _checkpoint_of_a_sharded_value(group: SliceGroup, x: np.ndarray, root: Path) -> None:
    """A gang's checkpoint of the value ``probe`` (``x``, its rows split between the members): each member writes
    its own shards, the commit's checksum is over their digests; one process reads it back whole and checked, the
    group reads it back in the same layout (its digests compared) and in another (checked whole on the lead), and
    bytes that are not the committed ones are refused (workers/gang/checkpoint.py)."""
    gang = GangSlice("s", group, [4], ["d"])
    probe = GroupValue(gang, "probe", np.dtype(np.float32), x.shape)
    steps = GangSteps(root / "s" / "w", gang)
    checksum = steps.save(1, {"x": [probe]})
    step_dir = root / "s" / "w" / "1"
    assert not step_dir.exists() and steps.all_steps() == [], "a step counted before its members wrote it"
    steps.wait_until_finished()  # the members have written: the step is finalized
    assert checksum.startswith(SHARDED) and [e["index"][0] for e in read_listing(step_dir)] == \
        [[0, 4], [4, 8], [8, 12], [12, 16]]
    assert not [p for p in (root / "s" / "w").iterdir() if p.name != "1"], "a temporary directory was left"
    commit = CheckpointCommit("j", "s", 1, str(step_dir), checksum)
    assert np.array_equal(restore_commit(commit, root / "s")["x"][0], x)
    for spec, checked in ((["d"], "shards"), ([], "gathered")):
        back = restore_on_gang(commit, root / "s", gang, {"x": [GroupSharding(gang, {"mesh": "m", "spec": spec})]})
        assert np.array_equal(np.asarray(back["x"][0]), x), checked
    with pytest.raises(CheckpointCorrupt, match="is corrupt: committed checksum sha256-shards:0000"):
        restore_on_gang(dataclasses.replace(commit, checksum=SHARDED + "0" * 64), root / "s", gang,
                        {"x": [GroupSharding(gang, {"mesh": "m", "spec": ["d"]})]})


def test_a_killed_member_loses_the_group_and_abort_stops_the_survivor_at_once(program: bytes, group: SliceGroup) -> None:
    _setup(group, program)
    group.put("w", W0, "m", [])
    _run(group, 0, 1, [])
    os.kill(group.members[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(GroupLost) as lost:
        _run(group, 1, 2, [])
    assert lost.value.member == 1 and "killed by SIGKILL" in str(lost.value), str(lost.value)
    survivor = group.members[0].pid
    group.abort()
    # Stopped by the abort, well before JAX's own heartbeat timeout (30 s here) would have ended it.
    assert _gone([survivor], 5.0) and time.monotonic() - t0 < 20.0


def test_a_hung_member_is_lost_at_the_request_deadline(program: bytes) -> None:
    group = SliceGroup.form(2, 2, request_timeout_s=3.0, heartbeat_s=30)
    try:
        _setup(group, program)
        group.put("w", W0, "m", [])
        os.kill(group.members[1].pid, signal.SIGSTOP)
        with pytest.raises(GroupLost) as lost:
            _run(group, 0, 1, [])
        assert "hung or partitioned" in str(lost.value), str(lost.value)
    finally:
        pids = group.pids()
        group.abort()
    assert _gone(pids, 5.0)


def test_a_bad_request_is_the_users_error_and_the_group_stays(program: bytes, group: SliceGroup) -> None:
    _setup(group, program)
    with pytest.raises(GroupError) as err:
        group.put("w", np.zeros((3, 8), np.float32), "m", ["d"])  # 3 rows do not split over 4 devices
    assert "value 'w'" in str(err.value)
    with pytest.raises(GroupError, match="needs 8 devices; the group has 4"):
        group.mesh("big", [8], ["d"])
    group.put("w", W0, "m", [])
    _run(group, 0, 1, [])  # the group still runs
