"""Another device count on a real local cluster: what is refused, and what travels.

The shrink after a loss and the grow back (the FSDP example's sharded state restored onto 2
devices, then drained back onto 4, within :data:`rallypoint.proto.digest.RESHARD_TOLERANCE`) is the
chaos scenario ``shrink-grow`` (tests/chaos/test_scenarios.py checks that it shrank and grew); the
LM's 2-D layout through a shrink: tests/integration/test_lm_sharded.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rallypoint.client.compile import compile_program
from rallypoint.cluster.local import LocalCluster
from tests.examples import example
from tests.helpers.cluster import assert_settled, run



def test_shrink_is_refused_at_submit_for_a_job_whose_slices_cannot_run_on_fewer_devices(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    from rallypoint.client.submission import JobError

    compiled = compile_program(example("pipeline_mlp").build(steps=4))
    lc = local_cluster(workers=4, spares=0, devices_per_worker=1, coordinators=1)
    with pytest.raises(JobError, match=r"on_no_spare='shrink' needs a slice that may run on fewer devices"):
        run(lc, compiled, [], on_no_spare="shrink")
    assert_settled(lc)


def test_the_wire_never_carries_every_variant_to_a_worker() -> None:
    from rallypoint.client.jobspec import job_spec
    from rallypoint.recovery.load_plan import SlicePlace, load_requests

    compiled = compile_program(example("data_parallel").build(steps=2))
    spec = job_spec(compiled)
    assert {v.devices for n in spec.nodes for v in n.variants} == {2}
    for count in (4, 2):
        (req,) = load_requests(spec, {"dp": SlicePlace("w", "a", 1, tuple(range(count)))}, cluster="c",
                               term=1).values()
        assert list(req.slices[0].mesh_shape) == [count]
        assert all(not n.variants for n in req.nodes) and all(not s.init_variants for s in req.states)
        want = {n.name: (n.exported if count == 4 else n.variants[0].exported) for n in spec.nodes}
        assert {n.name: n.exported for n in req.nodes} == want
