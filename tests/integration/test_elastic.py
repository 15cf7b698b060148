"""Another device count on a real local cluster: shrink onto fewer devices after a loss, grow back.

The FSDP example (its weights and Adam's moments split over the slice's devices) declares its
slice ``devices=(2, 4)``: its programs, and its state's layout, are exported for 4 and 2 devices.
A loss with no 4-device spare restores the slice onto 2 devices of a half-used worker
(``on_no_spare='shrink'``), each leaf split over the 2-device mesh; once a worker with room for 4
appears, a drain moves it back onto 4. The run then matches the reference within
:data:`rallypoint.proto.digest.RESHARD_TOLERANCE`, and says so in ``job.finished``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import jax
import numpy as np
import pytest

from rallypoint.client.compile import compile_program
from rallypoint.client.commands.faults import Fault
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.cluster.local import LocalCluster
from rallypoint.orchestrator.control.devices import DeviceLeases
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto.digest import RESHARD_TOLERANCE, states_close
from tests.examples import example
from tests.helpers.cluster import assert_settled, run

STEPS = 300


def final_leaves(result) -> dict[str, list[np.ndarray]]:  # type: ignore[no-untyped-def]
    return {name: [np.asarray(x) for x in jax.tree_util.tree_leaves(v)] for name, v in result.states.items()}


def test_a_slice_shrinks_onto_fewer_devices_after_a_loss_then_grows_back_within_the_tolerance(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    compiled = compile_program(example("fsdp").build(steps=STEPS))
    reference = ReferenceExecutor(compiled).run()
    lc = local_cluster(workers=1, spares=2, devices_per_worker=4, coordinators=1)
    store = lc.store()
    leases = DeviceLeases(store, lc.keys)
    try:
        assert leases.lease("blocker", "b", "w1", [0, 1]) is not None  # w1: 2 of its 4 devices busy
        leases.cordon("w2")  # w2 joins later (uncordoned once the slice has shrunk)
        events: list[pb.JobEvent] = []

        def on_event(ev: pb.JobEvent) -> None:
            events.append(ev)
            if ev.event == "job.recovered":
                leases.uncordon("w2")

        result, injector = run(lc, compiled, [Fault("dp", "dp", 40)], on_event=on_event, on_no_spare="shrink",
                               checkpoint_every=10, final_state="host")
        assert isinstance(result.states["params"]["w1"], np.ndarray)  # as asked, not laid out on this process
        rec = result.recovery
        (r,) = rec["recoveries"]
        assert r["moved"] == {"dp": "w1"}
        shrink, grow = rec["resharded"]
        assert (shrink["slice"], shrink["from"], shrink["to"]) == ("dp", 4, 2)
        assert (grow["slice"], grow["from"], grow["to"]) == ("dp", 2, 4)
        (d,) = rec["drains"]
        assert d["reason"] == "grow" and d["state"] == "done" and d["moved"] == {"dp": "w2"}
        assert rec["exact"] is False and rec["tolerance"] == RESHARD_TOLERANCE
        drained = next(json.loads(e.detail) for e in events if e.event == "job.drained")
        assert len(drained["placement"]["dp"]["devices"]) == 4
        # Not bitwise (the reductions ran in another order on 2 devices), but within the tolerance.
        ok, evidence = states_close(final_leaves(result), final_leaves(reference), **RESHARD_TOLERANCE)
        assert ok, evidence
        assert injector.fired[0]["worker"] == "w0"
    finally:
        leases.release("blocker")
        store.close()
    assert_settled(lc)


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
