"""Sharded state on a real local cluster: recovered bitwise after a kill, resharded onto fewer devices and back
(docs/program-api.md "Sharded state"), and the Flax NNX example's logically annotated state through a kill. A multi-host slice's sharded state, split across its members through a
drain, a kill and the in-memory tier: tests/integration/test_gang_runtime.py.

The job (tests/helpers/fsdp.py) keeps its weights and Adam's moments split over the slice's ``data`` axis.
A run that loses its worker and is restored onto a spare of the same shape ends bitwise equal to the in-process
reference; one that shrinks 4 -> 2 and grows back ends within the reshard tolerance and says so.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from rallypoint.client.commands.faults import Fault
from rallypoint.client.compile import compile_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.cluster.local import LocalCluster
from rallypoint.orchestrator.control.devices import DeviceLeases
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto.digest import RESHARD_TOLERANCE, states_close
from tests.helpers.cluster import assert_settled, run
from tests.examples import example

fsdp = example("fsdp")

STEPS = 20


def _leaves(result) -> dict[str, list[np.ndarray]]:  # type: ignore[no-untyped-def]
    return {name: [np.asarray(x) for x in jax.tree_util.tree_leaves(v)] for name, v in result.states.items()}


def test_a_sharded_state_is_recovered_bitwise_after_a_kill_and_resharded_onto_fewer_devices_and_back(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    compiled = compile_program(fsdp.build(steps=STEPS))
    reference = ReferenceExecutor(compiled).run()
    lc = local_cluster(workers=1, spares=3, devices_per_worker=4, coordinators=1)
    store = lc.store()
    leases = DeviceLeases(store, lc.keys)
    try:
        # A kill with a spare of the slice's shape: restored shard by shard onto it, bitwise.
        killed, injector = run(lc, compiled, [Fault("dp", "dp", 7)], checkpoint_every=5)
        assert killed.state_digest == reference.state_digest
        w1 = killed.states["params"]["w1"]  # handed back laid out as it was (this process has the 4 devices)
        assert w1.sharding.spec == P(None, "data") and {s.data.shape for s in w1.addressable_shards} == {(16, 16)}
        assert len(killed.recovery["recoveries"]) == 1 and killed.recovery.get("exact", True) is True
        lost = injector.fired[0]["worker"]

        # No spare of 4 devices: the slice shrinks onto 2 (its layout over the 2-device mesh), then grows back.
        survivors = sorted({"w0", "w1", "w2", "w3"} - {lost})
        half, later = survivors[1], survivors[2]
        assert leases.lease("blocker", "b", half, [0, 1]) is not None
        leases.cordon(later)

        def on_event(ev: pb.JobEvent) -> None:
            if ev.event == "job.recovered":
                leases.uncordon(later)

        resharded, _ = run(lc, compile_program(fsdp.build(steps=STEPS)), [Fault("dp", "dp", 7)],
                           on_event=on_event, on_no_spare="shrink", checkpoint_every=5, new_run=True,
                           final_state="host")
        assert isinstance(resharded.states["params"]["w1"], np.ndarray)
        rec = resharded.recovery
        shrink, grow = rec["resharded"]
        assert (shrink["from"], shrink["to"], grow["from"], grow["to"]) == (4, 2, 2, 4)
        assert rec["exact"] is False and rec["tolerance"] == RESHARD_TOLERANCE
        ok, evidence = states_close(_leaves(resharded), _leaves(reference), **RESHARD_TOLERANCE)
        assert ok, evidence
    finally:
        leases.release("blocker")
        store.close()
    assert_settled(lc)


def test_the_sharded_flax_example_recovers_from_a_kill_bitwise(local_cluster: Callable[..., LocalCluster]) -> None:
    """examples/flax_fsdp.py: its train state split over a (2, 4) mesh of one worker's 8 CPU devices (parameters and
    Adam's moments a quarter per device); a spare restores it from a saved cut and the job ends on the reference."""
    compiled = compile_program(example("flax_fsdp").build(steps=24))
    assert compiled.states["state"].sharded
    reference = ReferenceExecutor(compiled).run()
    lc = local_cluster(workers=1, spares=1, devices_per_worker=8, coordinators=1)
    result, injector = run(lc, compiled, [Fault("main", "main", 14)], checkpoint_every=5)
    assert injector.fired[0]["worker"] == "w0"
    (r,) = result.recovery["recoveries"]
    assert r["moved"] == {"main": "w1"}
    assert 0 < r["checkpoint_step"] <= 14  # restored from a saved cut of the sharded state, not from init
    assert result.recovery["exact"] is True
    assert result.state_digest == reference.state_digest
    assert_settled(lc)
