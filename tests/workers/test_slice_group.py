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
import numpy as np
import pytest
from jax.sharding import Mesh
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.workers.checkpoints.restore import restore_commit
from rallypoint.workers.errors import CheckpointCorrupt
from rallypoint.workers.checkpoints.checksums import SHARDED, read_listing
from rallypoint.workers.gang.lead import GangExecutable, GangSlice, GroupSharding, GroupValue
from rallypoint.workers.gang.checkpoint import GangSteps, restore_on_gang
from rallypoint.workers.programs import load_exported
from rallypoint.workers.gang.group import GroupError, GroupLost, SliceGroup
from tests.helpers.slice_group import W0, WIDTH, all_gone, batch_at, run_steps, setup_group, train_step_bytes

pytestmark = pytest.mark.processes

STEPS = 6


@pytest.fixture(scope="module")
def program() -> bytes:
    return train_step_bytes()


@pytest.fixture
def group() -> Iterator[SliceGroup]:
    g = SliceGroup.form(2, 2, request_timeout_s=30.0, heartbeat_s=30)
    yield g
    g.abort()


def test_a_group_forms_runs_the_exported_step_shard_by_shard_and_a_restored_group_ends_bitwise_equal(
    program: bytes, group: SliceGroup, tmp_path: Path,
) -> None:
    # Formed: one set of 4 global devices, 2 local to each member, process ids in the gang's order.
    assert [m.ready["process"] for m in group.members] == [0, 1]
    assert all(m.ready["devices"] == 4 and len(m.ready["local"]) == 2 for m in group.members)
    setup_group(group, program)
    # Shard by shard: each member is sent only its half of the batch and holds only its half.
    x, _ = batch_at(0)
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
    run_steps(group, 0, 3, losses)
    saved = group.save(str(tmp_path / "cut3"), {"w": ["w"]})
    assert [e[:5] for e in saved] == [["w", 0, [[0, WIDTH], [0, WIDTH]], "float32", [WIDTH, WIDTH]]], saved
    run_steps(group, 3, STEPS, losses)
    final = group.fetch("w")
    assert losses[-1] < losses[0], losses
    # The same step in one process over 4 devices agrees (the reduction crosses processes through gloo).
    w = W0
    f = load_exported(program, Mesh(np.array(jax.devices()[:4]), ("d",)))
    for s in range(STEPS):
        w, _ = f(w, *batch_at(s))
    np.testing.assert_allclose(np.asarray(w), final, rtol=1e-5, atol=1e-6)
    # A new group restores the cut, each member reading its own shards, and replays: bitwise the same state.
    group.close()
    again = SliceGroup.form(2, 2, request_timeout_s=30.0, heartbeat_s=30)
    try:
        setup_group(again, program)
        got = again.restore(str(tmp_path / "cut3"), {"w": [{"value": "w", "mesh": "m", "spec": [],
                                                            "shape": [WIDTH, WIDTH], "dtype": "float32"}]})
        assert got == saved  # the same bytes read back (each shard's digest)
        replayed: list[float] = []
        run_steps(again, 3, STEPS, replayed)
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


def test_an_instance_on_a_gang_is_one_request_carrying_its_small_arguments_and_bringing_back_its_metric(
    program: bytes, group: SliceGroup,
) -> None:
    """The batch (512 bytes a leaf) travels in the call and the loss (a scalar) comes back in its answer: one
    group round trip a step, where a put per host argument and a fetch per metric took four. The states and
    losses are bitwise those of the explicit put, call and fetch."""
    gang = GangSlice("s", group, [4], ["d"])
    step = GangExecutable(program, gang)
    requests: list[str] = []
    send = group.request

    def counted(header, *args, **kwargs):  # type: ignore[no-untyped-def]
        requests.append(header["op"])
        return send(header, *args, **kwargs)

    group.request = counted  # type: ignore[method-assign]
    w = gang.put(W0, {"mesh": "m", "spec": []})
    group.put("w_explicit", W0, "m", [])
    for s in range(3):
        x, y = batch_at(s)
        requests.clear()
        w, loss = step(w, x, y)
        assert requests == ["call"], requests
        assert np.asarray(loss).shape == () and requests == ["call"], "the loss was fetched in a request of its own"
        group.put("x", x, "m", ["d"])
        group.put("y", y, "m", ["d"])
        group.request({"op": "call", "prog": step.prog, "args": ["w_explicit", "x", "y"],
                       "outs": ["w_explicit", "loss_explicit"]})
        assert np.asarray(loss).tobytes() == group.fetch("loss_explicit").tobytes(), s
    assert np.array_equal(np.asarray(w), group.fetch("w_explicit"))


def test_a_killed_member_loses_the_group_and_abort_stops_the_survivor_at_once(program: bytes, group: SliceGroup) -> None:
    setup_group(group, program)
    group.put("w", W0, "m", [])
    run_steps(group, 0, 1, [])
    os.kill(group.members[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(GroupLost) as lost:
        run_steps(group, 1, 2, [])
    assert lost.value.member == 1 and "killed by SIGKILL" in str(lost.value), str(lost.value)
    survivor = group.members[0].pid
    group.abort()
    # Stopped by the abort, well before JAX's own heartbeat timeout (30 s here) would have ended it.
    assert all_gone([survivor], 5.0) and time.monotonic() - t0 < 20.0


def test_a_hung_member_is_lost_at_the_request_deadline(program: bytes) -> None:
    group = SliceGroup.form(2, 2, request_timeout_s=3.0, heartbeat_s=30)
    try:
        setup_group(group, program)
        group.put("w", W0, "m", [])
        os.kill(group.members[1].pid, signal.SIGSTOP)
        with pytest.raises(GroupLost) as lost:
            run_steps(group, 0, 1, [])
        assert "hung or partitioned" in str(lost.value), str(lost.value)
    finally:
        pids = group.pids()
        group.abort()
    assert all_gone(pids, 5.0)


def test_a_bad_request_is_the_users_error_and_the_group_stays(program: bytes, group: SliceGroup) -> None:
    setup_group(group, program)
    with pytest.raises(GroupError) as err:
        group.put("w", np.zeros((3, 8), np.float32), "m", ["d"])  # 3 rows do not split over 4 devices
    assert "value 'w'" in str(err.value)
    with pytest.raises(GroupError, match="needs 8 devices; the group has 4"):
        group.mesh("big", [8], ["d"])
    group.put("w", W0, "m", [])
    run_steps(group, 0, 1, [])  # the group still runs
