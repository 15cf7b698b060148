"""The ``corrupt`` fault hook (workers/corruption.py): one bit of a state update flipped, silently.

The flip itself (pure: exactly one bit differs), the specs a flag file holds and which updates they match,
and two runtimes served in this process: a worker with the hook corrupts the state update the spec names
(the final state differs from the reference in exactly one bit), a worker without it has no path to read
a spec from, and ends bitwise equal to the reference.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from rallypoint.basics.errors import ConfigError
from rallypoint.cluster import daemons
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig
from rallypoint.workers import corruption
from rallypoint.workers import daemon as worker_daemon
from rallypoint.workers.corruption import (CorruptSpec, StateCorruption, corruption_hook, flip_array_bit, flip_bit,
                                           parse_specs, read_specs, write_specs)
from rallypoint.workers.faults import NO_FAULTS, WorkerFaults
from tests.helpers.runtime import compiled_and_reference, load, started_workers


def bits_differing(a: np.ndarray, b: np.ndarray) -> int:
    x = np.frombuffer(np.ascontiguousarray(a).tobytes(), np.uint8)
    y = np.frombuffer(np.ascontiguousarray(b).tobytes(), np.uint8)
    return int(np.unpackbits(x ^ y).sum())


@pytest.mark.parametrize("value", [
    np.arange(6, dtype=np.float32).reshape(2, 3), np.linspace(-1, 1, 5, dtype=np.float64),
    np.ones(4, dtype=ml_dtypes.bfloat16), np.array(3.5, dtype=np.float16), np.arange(3, dtype=np.int32),
    np.array([True, False]), np.arange(4, dtype=">f4"),
])
def test_the_flip_changes_exactly_one_bit_of_element_zero_and_leaves_the_input_alone(value: np.ndarray) -> None:
    before = value.copy()
    out = flip_array_bit(value)
    assert out.dtype == value.dtype and out.shape == value.shape
    assert bits_differing(out, value) == 1
    assert out.reshape(-1)[0] != value.reshape(-1)[0] and np.array_equal(out.reshape(-1)[1:], value.reshape(-1)[1:])
    assert np.array_equal(value, before) and bits_differing(value, before) == 0  # a copy was flipped
    assert bits_differing(flip_array_bit(out), value) == 0  # the same bit again: deterministic
    if value.dtype.kind == "f":  # the lowest mantissa bit: a nearby number, never a NaN or an infinity
        assert np.isfinite(out.astype(np.float64)).all()
    for bit in range(8):  # the other bits of the lowest byte: one bit each, element 0 only
        other = flip_array_bit(value, bit)
        assert bits_differing(other, value) == 1 and np.array_equal(other.reshape(-1)[1:], value.reshape(-1)[1:])
    with pytest.raises(ValueError):
        flip_array_bit(np.zeros((0, 3), np.float32))
    with pytest.raises(ValueError):
        flip_array_bit(value, 8)


def test_flip_bit_takes_the_first_leaf_with_an_element_and_puts_it_back_on_its_devices() -> None:
    devices = jax.devices()[:2]
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    leaves = [jnp.zeros((0,)), jax.device_put(jnp.arange(4, dtype=jnp.float32), sharding), np.ones(2, np.float32)]
    out, index = flip_bit(leaves)
    assert index == 1 and out[0] is leaves[0] and out[2] is leaves[2]
    assert out[1].sharding == sharding and bits_differing(np.asarray(out[1]), np.asarray(leaves[1])) == 1
    assert float(leaves[1][0]) == 0.0  # the value given is not changed
    assert flip_bit([np.zeros((0,), np.float32)])[1] is None and flip_bit([])[1] is None


def test_specs_parse_from_an_object_or_a_list_and_bad_ones_are_refused(tmp_path: Path) -> None:
    assert parse_specs('{"slice": "s", "step": 3}') == [CorruptSpec("s", 3, "persist")]
    assert parse_specs('[{"slice": "s", "step": 0, "mode": "once", "worker": "w1", "node": "n"}]') == \
        [CorruptSpec("s", 0, "once", worker="w1", node="n")]
    for bad in ('not json', '{"slice": "s"}', '{"slice": "s", "step": -1}', '{"slice": "s", "step": 1, "mode": "x"}',
                '{"slice": "s", "step": 1, "color": "red"}', '[3]', '{"slice": "", "step": 1}'):
        with pytest.raises((ConfigError, TypeError)):
            parse_specs(bad)
    flag = tmp_path / "flag.json"
    assert read_specs(flag) == []
    specs = [CorruptSpec("a", 1, "once", worker="w0"), CorruptSpec("b", 2)]
    write_specs(flag, specs)
    assert read_specs(flag) == specs and [p.name for p in tmp_path.iterdir()] == ["flag.json"]


def test_once_flips_the_first_matching_update_and_persist_every_one_from_the_step(tmp_path: Path) -> None:
    flag = tmp_path / "flag.json"
    write_specs(flag, [CorruptSpec("s1", 3, "once", worker="w0"), CorruptSpec("s2", 2, "persist", node="upd"),
                       CorruptSpec("s3", 0, "persist", worker="w9")])
    hook = StateCorruption(flag, "w0")
    x = [np.arange(4, dtype=np.float32)]

    def flipped(slice_name: str, node: str, step: int, job: str = "j") -> bool:
        return bits_differing(hook(job, slice_name, node, step, x)[0], x[0]) == 1

    assert [flipped("s1", "n", s) for s in range(6)] == [False, False, False, True, False, False]
    assert [flipped("s2", "upd", s) for s in range(6)] == [False, False, True, True, True, True]
    assert [r["bit"] for r in hook.corrupted] == [0, 0, 1, 2, 3]  # once: bit 0; persist: a bit further each time
    assert not flipped("s2", "other", 4)  # another node of the slice
    assert not flipped("s3", "n", 5)  # a spec naming another worker
    assert not flipped("s4", "n", 5)  # another slice
    assert hook.count == 5 and hook.corrupted[0] == {"job": "j", "slice": "s1", "node": "n", "step": 3, "leaf": 0,
                                                     "bit": 0, "mode": "once"}
    flag.unlink()  # disarmed: seen at the next step's poll
    assert not flipped("s2", "upd", 6)


def test_the_flag_file_is_stat_ed_at_most_once_per_step_and_a_bad_one_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flag = tmp_path / "flag.json"
    flag.write_text("{not json")
    hook = StateCorruption(flag, "w0")
    stats: list[str] = []
    real_stat = os.stat
    monkeypatch.setattr(corruption.os, "stat", lambda p, *a, **k: stats.append(str(p)) or real_stat(p, *a, **k))
    x = [np.ones(2, np.float32)]
    for step in (0, 0, 0, 1, 1, 0, 2, 2):
        assert hook("j", "s", "n", step, x) is x  # refused spec: nothing armed
    assert len(stats) == 4, stats  # steps 0, 1, 0 again (a replay from a checkpoint) and 2 of slice s
    hook("j", "t", "n", 2, x)
    assert len(stats) == 5  # another slice polls for itself
    write_specs(flag, [CorruptSpec("s", 0)])
    assert hook("j", "s", "n", 2, x) is x  # step 2 was polled already: seen at step 3
    assert hook("j", "s", "n", 3, x) is not x


def test_a_once_spec_written_again_naming_its_worker_does_not_fire_again(tmp_path: Path) -> None:
    """`--fail corrupt-once` writes the spec before the job is placed (no worker), then naming the worker: one
    fault, one flip, even when it fired in between."""
    flag = tmp_path / "flag.json"
    write_specs(flag, [CorruptSpec("s", 2, "once")])
    hook = StateCorruption(flag, "w0")
    x = [np.ones(2, np.float32)]
    assert hook("j", "s", "n", 2, x) is not x
    write_specs(flag, [CorruptSpec("s", 2, "once", worker="w0")])
    assert [hook("j", "s", "n", step, x) is x for step in (3, 4)] == [True, True] and hook.count == 1


def test_a_worker_without_the_flag_option_has_no_hook(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert corruption_hook(NO_FAULTS.corrupt_flag, "w0") is None
    assert WorkerFaults(corrupt_flag="/f").args() == ["--fault-corrupt-flag", "/f"]
    cfg = LocalClusterConfig(state_dir=tmp_path / "c", worker_faults=WorkerFaults(corrupt_flag="/f"))
    assert LocalCluster(cfg, ["127.0.0.1:1"], []).argv("worker", "w0")[-2:] == ["--fault-corrupt-flag", "/f"]
    assert "--fault-corrupt-flag" not in LocalCluster(LocalClusterConfig(state_dir=tmp_path / "d"), ["x:1"],
                                                      []).argv("worker", "w0")
    (tmp_path / "c").mkdir()
    LocalCluster(cfg, ["127.0.0.1:1"], []).save()  # `rallypoint down` reads the config back
    assert LocalCluster.load(tmp_path / "c").config.worker_faults.corrupt_flag == "/f"
    configs: list[Any] = []

    class FakeDaemon:
        def __init__(self, config: Any) -> None:
            configs.append(config)
            self.start = self.run = self.request_stop = self.stop = self.request_preemption = lambda: None

    monkeypatch.setattr(worker_daemon, "WorkerDaemon", FakeDaemon)
    monkeypatch.setattr(daemons, "configure_logs", lambda: None)
    base = ["worker", "--cluster", "t@127.0.0.1:1", "--id", "w0", "--insecure"]
    for args in ([*base, "--fault-corrupt-flag", "/flag.json"], base):
        r = CliRunner().invoke(daemons.main, args)
        assert r.exit_code == 0, r.output
    assert [c.faults.corrupt_flag for c in configs] == ["/flag.json", ""]


def test_a_hooked_worker_corrupts_the_named_update_and_one_without_the_hook_ignores_the_spec(tmp_path: Path) -> None:
    """data_parallel (one slice "dp" of 4 devices, replicated parameters, 4 steps) on wB. A spec naming dp at
    step 3 (the last: its update is the final state), once: wB with the hook ends one bit off the reference, in
    the first leaf; wB without it (the hook on wA only, which holds no dp) ends bitwise equal."""
    compiled, reference = compiled_and_reference("data_parallel")
    flag = tmp_path / "corrupt.json"
    write_specs(flag, [CorruptSpec("dp", 3, "once")])
    want = {n: [np.asarray(x) for x in jax.tree_util.tree_leaves(v)] for n, v in reference.states.items()}

    def final_states(hooked: str) -> dict[str, list[np.ndarray]]:
        with started_workers(faults={hooked: WorkerFaults(corrupt_flag=str(flag))}) as ws:
            job = load("data_parallel", ws)
            job.grant(compiled.program.steps)
            job.wait_instances(compiled.program.steps)
            got = job.fetch_states()
            counts = {w: (ws[w].service.corrupt.count if ws[w].service.corrupt else None) for w in ws}
            job.unload()
        assert counts == ({"wA": None, "wB": 1} if hooked == "wB" else {"wA": 0, "wB": None}), counts
        return {n: [np.asarray(x) for x in jax.tree_util.tree_leaves(v)] for n, v in got.items()}

    got = final_states("wB")
    diffs = [(n, i, bits_differing(g, w)) for n in want for i, (g, w) in enumerate(zip(got[n], want[n], strict=True))]
    (changed,) = [d for d in diffs if d[2]]  # one leaf of one state: its first leaf, one bit
    assert changed[1:] == (0, 1), diffs
    got = final_states("wA")
    assert all(bits_differing(g, w) == 0 for n in want for g, w in zip(got[n], want[n], strict=True))
