"""Sharded state on a real local cluster: the Flax NNX example's logically annotated state restored onto a spare
from a saved cut, bitwise, and handed back laid out as it was (docs/program-api.md "Sharded state").

Elsewhere: the FSDP example through a kill, a suspend and resume, a drain and a hang (scenarios/fsdp.toml) and
through a shrink and a grow (scenarios/shrink-grow.toml); the LM's fsdp and tp variants through a kill and a
shrink (tests/integration/test_lm_sharded.py); a gang's sharded state through a drain, a kill, the in-memory tier
and a partition (tests/integration/test_gang_runtime.py).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

from jax.sharding import PartitionSpec as P

from rallypoint.client.compile import compile_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.cluster.local import LocalCluster
from rallypoint.proto import rallypoint_pb2 as pb
from tests.helpers.cluster import assert_settled, run
from tests.examples import example


STEPS = 60


def _kill_once_a_cut_is_committed(lc: LocalCluster, job: str, slice_name: str,
                                  killed_at: list[int]) -> Callable[[pb.JobEvent], None]:
    """SIGKILL w0 at the first step done after the slice committed a cut past step 0, so that the spare restores
    saved shards, not the init."""
    def on_event(ev: pb.JobEvent) -> None:
        committed = Path(lc.checkpoint_dir).glob(f"{job}/*/commits/{slice_name}/*.json")
        if ev.event == "step.done" and not killed_at and any(int(p.stem) > 0 for p in committed):
            killed_at.append(int(ev.step))
            lc.signal("w0", signal.SIGKILL)

    return on_event


def test_the_sharded_flax_example_recovers_from_a_kill_bitwise(local_cluster: Callable[..., LocalCluster]) -> None:
    """examples/flax_fsdp.py: its train state split over a (2, 4) mesh of one worker's 8 CPU devices (parameters and
    Adam's moments a quarter per device); a spare restores it from a saved cut and the job ends on the reference."""
    compiled = compile_program(example("flax_fsdp").build(steps=STEPS))
    assert compiled.states["state"].sharded
    reference = ReferenceExecutor(compiled).run()
    lc = local_cluster(workers=1, spares=1, devices_per_worker=8, coordinators=1)
    killed_at: list[int] = []
    result, _ = run(lc, compiled, [], on_event=_kill_once_a_cut_is_committed(lc, "flax-fsdp", "main", killed_at),
                    checkpoint_every=5)
    assert killed_at
    (r,) = result.recovery["recoveries"]
    assert r["moved"] == {"main": "w1"}
    assert 0 < r["checkpoint_step"] <= killed_at[0]  # restored from a saved cut of the sharded state, not from init
    assert result.recovery["exact"] is True
    assert result.state_digest == reference.state_digest
    # Handed back laid out as it was: this process has the slice's 8 devices (the tests give it 8)
    w1 = result.states["state"]["params"]["w1"]
    assert w1.sharding.spec == P(None, "model") and {s.data.shape for s in w1.addressable_shards} == {(8, 16)}
    assert_settled(lc)
