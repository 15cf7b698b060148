"""The storage injectors choose the checkpoint to damage from etcd (a real server, real commits)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint.chaos.injectors import InjectionError, newest_commit
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import Put, created_at
from rallypoint.workers.checkpoints.checkpointer import SliceCheckpointer
from rallypoint.workers.checkpoints.committer import etcd_commit
from tests.helpers.checkpoints import register, states_at


def test_the_checkpoint_damaged_is_the_workers_newest_even_before_the_leader_promotes_it(
        store: EtcdStore, tmp_path: Path) -> None:
    # A frozen worker's commit of step 20 is in etcd at its own key; the leader (loaded) has promoted only step 10.
    # Damaging step 10 would let a recovery restore the intact step 20 and never exercise the damaged restore.
    keys = Keys("t")
    with pytest.raises(InjectionError, match="no committed checkpoint yet"):
        newest_commit(store, keys, "j", "s0", "w1")
    inc = register(store, keys, "w1")
    ck = SliceCheckpointer(tmp_path / "s0", commit=etcd_commit(store, keys, created_at(keys.worker("w1"), inc)),
                           job="j", slice_name="s0", max_to_keep=None)
    try:
        for step in (10, 20):
            ck.save(step, states_at(step))
        ck.wait()
    finally:
        ck.close()
    own = store.get(keys.worker_commit("w1", "j", "s0", 10))
    assert own is not None
    store.txn([], [Put(keys.checkpoint("j", "s0", 10), own.value)])  # the leader's promotion of step 10 only
    assert newest_commit(store, keys, "j", "s0", "w1").step == 20
    # Another worker's own commits are not this slice's worker's: they are not read.
    assert newest_commit(store, keys, "j", "s0", "w2").step == 10


def test_a_corrupt_fault_adds_a_spec_naming_the_slices_worker_to_the_flag_file(tmp_path: Path) -> None:
    from rallypoint.chaos.injectors import Injectors, Target
    from rallypoint.chaos.scenario import FaultSpec
    from rallypoint.workers.corruption import CorruptSpec, read_specs

    flag = tmp_path / "corrupt-fault.json"
    target = Target(lc=None, job="j", node_slice={"upd": "s1"},  # type: ignore[arg-type]
                    placement={"s0": "w0", "s1": "w1"}, corrupt_flag=flag)
    inj = Injectors(target)
    detail, heal = inj.fire(FaultSpec("corrupt", "s0", at_step=3, mode="once"))
    assert heal is None and detail["worker"] == "w0" and "struck_at" in detail
    inj.fire(FaultSpec("corrupt", "upd", at_s=1.0, mode="persist"))  # by time: from any step on
    assert read_specs(flag) == [CorruptSpec("s0", 3, "once", worker="w0"),
                                CorruptSpec("s1", 0, "persist", worker="w1", node="upd")]
    assert inj.fired["corrupt"] == 2
    with pytest.raises(InjectionError, match="without a corrupt flag"):
        Injectors(Target(lc=None, job="j", node_slice={}, placement={"s0": "w0"})).fire(  # type: ignore[arg-type]
            FaultSpec("corrupt", "s0", at_step=3))
