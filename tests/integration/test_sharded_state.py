"""examples/flax_fsdp.py on a real local cluster: its sharded state through a kill, ending bitwise on the reference.

The example's train state is split over a ``(2, 4)`` mesh of one worker's 8 CPU devices
(parameters and Adam's moments a quarter per device). The worker holding it is killed after a
checkpoint; a spare restores the sharded state and replays the steps since, and the job ends
with the digest of the in-process reference run of the same exported programs.
"""

from __future__ import annotations

from collections.abc import Callable

from rallypoint.client.commands.faults import Fault
from rallypoint.client.compile import compile_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.cluster.local import LocalCluster
from tests.examples import example
from tests.helpers.cluster import assert_settled, run

STEPS, EVERY, KILL_AT = 24, 5, 14


def test_the_sharded_flax_example_recovers_from_a_kill_bitwise(local_cluster: Callable[..., LocalCluster]) -> None:
    compiled = compile_program(example("flax_fsdp").build(steps=STEPS))
    assert compiled.states["state"].sharded
    reference = ReferenceExecutor(compiled).run()
    lc = local_cluster(workers=1, spares=1, devices_per_worker=8, coordinators=1)
    result, injector = run(lc, compiled, [Fault("main", "main", KILL_AT)], checkpoint_every=EVERY)
    assert injector.fired[0]["worker"] == "w0"
    (r,) = result.recovery["recoveries"]
    assert r["moved"] == {"main": "w1"}
    assert 0 < r["checkpoint_step"] <= KILL_AT  # restored from a saved cut of the sharded state, not from init
    assert result.recovery["exact"] is True
    assert result.state_digest == reference.state_digest
    assert_settled(lc)
