"""Sharded state on a real local cluster: recovered bitwise after a kill (docs/program-api.md "Sharded state"), and
the Flax NNX example's logically annotated state through a kill. Resharded onto fewer devices and back:
tests/integration/test_elastic.py. A multi-host slice's sharded state, split across its members through a
drain, a kill and the in-memory tier: tests/integration/test_gang_runtime.py.

The job (examples/fsdp.py) keeps its weights and Adam's moments split over the slice's ``data`` axis. A run that
loses its worker and is restored onto a spare of the same shape ends bitwise equal to the in-process reference.
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

fsdp = example("fsdp")

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


def test_a_sharded_state_is_restored_shard_by_shard_onto_a_spare_and_ends_bitwise_laid_out_as_it_was(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    compiled = compile_program(fsdp.build(steps=STEPS))
    reference = ReferenceExecutor(compiled).run()
    lc = local_cluster(workers=1, spares=1, devices_per_worker=4, coordinators=1)
    killed_at: list[int] = []
    killed, _ = run(lc, compiled, [], on_event=_kill_once_a_cut_is_committed(lc, "fsdp", "dp", killed_at),
                    checkpoint_every=5)
    assert killed_at and killed.state_digest == reference.state_digest
    (r,) = killed.recovery["recoveries"]
    assert r["moved"] == {"dp": "w1"} and r["checkpoint_step"] > 0 and killed.recovery["exact"] is True
    w1 = killed.states["params"]["w1"]  # handed back laid out as it was (this process has the 4 devices)
    assert w1.sharding.spec == P(None, "data") and {s.data.shape for s in w1.addressable_shards} == {(16, 16)}
    assert_settled(lc)


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
    assert_settled(lc)
