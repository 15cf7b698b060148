"""Pretrained weights in, on a real local cluster: a job started from a plain Orbax checkpoint (``init_from``), its
state sharded over the slice's 2 devices, loses its worker before the first cut; the spare reads the same
pretrained bytes again (checked against the checksum taken at submit), and the job ends bitwise on the reference,
whose first loss is the pretrained weights' own loss on that batch. The refusals at submit, the tree matching and
the sharded placement are tests/client/test_init_from.py (no processes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec as P

from rallypoint.client.commands.faults import Fault
from rallypoint.client.compile import compile_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.cluster.local import LocalCluster
from tests.helpers.cluster import assert_settled, run
from tests.helpers.pretrained import loss_of, pretrained, regression

STEPS, KILL_AT, EVERY = 8, 3, 5
SPECS = {"params": {"w1": P(None, "data"), "w2": P("data"), "b": P()}}


def test_a_job_from_pretrained_weights_recovers_a_kill_before_its_first_cut_bitwise(
        local_cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    weights = pretrained()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "pretrained", weights)
    compiled = compile_program(regression(steps=STEPS, devices=2, init_from=tmp_path / "pretrained", sharding=SPECS))
    assert compiled.states["state"].sharded
    reference = ReferenceExecutor(compiled).run()
    first = float(loss_of(weights, 0, devices=2, specs=SPECS))
    assert reference.metrics[0]["loss"] == first
    lc = local_cluster(workers=1, spares=1, devices_per_worker=2, coordinators=1)
    result, injector = run(lc, compiled, [Fault("main", "main", KILL_AT)], checkpoint_every=EVERY)
    assert injector.fired and injector.fired[0]["step"] == KILL_AT, injector.fired
    (r,) = result.recovery["recoveries"]
    assert r["checkpoint_step"] == 0, r  # before the first cut: the spare read the pretrained checkpoint again
    assert result.recovery["exact"] is True
    assert result.state_digest == reference.state_digest
    assert result.metrics[0]["loss"] == first
    assert_settled(lc)
