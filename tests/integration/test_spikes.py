"""Loss spikes rolled back on a real local cluster (docs/integrity.md): real etcd, a real worker process, real
Orbax checkpoints, and a data source that serves a poisoned batch at one stream position.

One small cluster for the module (one worker of one device, a spare, one coordinator). A linear regression
reads ``x`` from a JAX source of the stream position; the batch at position ``POISON`` is scaled 30x,
so its step's loss jumps over 60x its baseline and the poisoned gradient wrecks the weights. With
``on_spike = "rollback"`` the job rolls back to the cut ``REWIND`` steps before, skips the batches of
``[spike - REWIND, spike + SKIP)`` and ends bitwise equal to the in-process reference given the same
skip list, with the same loss curve. A learning rate that diverges spikes again after every rollback
and fails the job after ``max_rollbacks``. A NaN batch under ``on_nonfinite = "rollback"`` is rolled
back the same way. (The detector and the skips on their own: tests/recovery/test_spikes.py.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rallypoint.client.commands.jobs import integrity_lines, job_status
from rallypoint.client.compile import compile_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.submission import JobError, submit
from rallypoint.cluster.local import LocalCluster
from rallypoint.etcd.commits import read_commits
from rallypoint.orchestrator.job.metrics import METRICS_FILE, read_metrics
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.skips import Skips
from rallypoint.client.commands.faults import Fault
from tests.helpers.cluster import run, run_dir_of, small_cluster
from tests.helpers.regression import POISON, regression

STEPS, REWIND, SKIP = 16, 3, 2
SPIKES = {"on_spike": "rollback", "spike_window": 4, "spike_rewind": REWIND, "spike_skip": SKIP, "keep_checkpoints": 4}
@pytest.fixture(scope="module")
def lc(tmp_path_factory: pytest.TempPathFactory, compile_cache: Path) -> Iterator[LocalCluster]:
    with small_cluster(tmp_path_factory.mktemp("spikes"), compile_cache, spares=1) as cluster:
        yield cluster


def details(events: list[pb.JobEvent], name: str) -> list[dict[str, Any]]:
    return [{"step": e.step, **json.loads(e.detail)} for e in events if e.event == name]


def test_a_poisoned_batch_is_rolled_back_and_skipped_and_the_run_ends_bitwise_equal_to_the_reference_skipping_it(
    lc: LocalCluster,
) -> None:
    events: list[pb.JobEvent] = []
    result = submit(compile_program(regression("spiky")), endpoints=lc.endpoints, cluster=lc.keys.cluster,
                    on_event=events.append, **SPIKES)
    spikes, rollbacks = details(events, "job.spike"), details(events, "job.rolled_back")
    assert [(d["step"], d["metric"], d["action"]) for d in spikes] == [(POISON, "loss", "rollback")]
    assert spikes[0]["value"] > 60 * spikes[0]["baseline"]
    first = POISON - REWIND
    assert [(d["step"], d["cut"], d["skipped_steps"], d["skips"]) for d in rollbacks] == [
        (POISON, first, [first, POISON + SKIP], [[first, POISON + SKIP - first]])]
    expected = ReferenceExecutor(compile_program(regression("spiky")), skips=Skips.parse([f"{first}:{SKIP + REWIND}"]))
    reference = expected.run()
    assert result.state_digest == reference.state_digest  # bitwise, through the rollback
    assert result.recovery["rollbacks"] == 1
    # The loss curve: the client's and metrics.jsonl's (the last value per step) are the reference's.
    assert [m["loss"] for m in result.metrics] == [m["loss"] for m in reference.metrics]
    curve = read_metrics(run_dir_of(lc, "spiky") / METRICS_FILE)
    assert [v for _, v in curve.curve("loss")] == pytest.approx([m["loss"] for m in reference.metrics], rel=1e-6)
    assert [(m["kind"], m["step"]) for m in curve.plot_marks()] == [("spike", POISON), ("rollback", POISON)]
    # The record keeps the skips (a resume or adoption reads them); no commit holds a state the spike made.
    store = lc.store()
    try:
        record = store.get(lc.keys.job("spiky")).json()
        assert record["skips"] == [[first, POISON + SKIP - first]] and record["rollback_count"] == 1
        lines = integrity_lines(job_status(store, lc.keys, "spiky"))  # `rallypoint status`
        assert f"--skip {first}:{POISON + SKIP - first}" in lines[0] and lines[1].startswith("rollback 1: loss"), lines
        assert sorted(c.step for c in read_commits(store, lc.keys, "spiky")["s"])[-1] == STEPS
    finally:
        store.close()


def test_a_worker_killed_after_a_rollback_replays_on_the_spare_with_the_same_skipped_batches(lc: LocalCluster) -> None:
    """The skips travel with every load: the spare that takes the killed worker's slice reads what it read."""
    events: list[pb.JobEvent] = []
    result, injector = run(lc, compile_program(regression("spiky-kill")), [Fault("s", "s", 12)], **SPIKES,
                           checkpoint_every=2, on_event=events.append)
    assert [f["step"] for f in injector.fired] == [12] and len(result.recovery["recoveries"]) == 1
    names = [e.event for e in events]
    assert names.index("job.rolled_back") < names.index("job.recovering"), names
    assert result.recovery["rollbacks"] == 1
    reference = ReferenceExecutor(compile_program(regression("spiky-kill")),
                                  skips=Skips.parse([f"{POISON - REWIND}:{SKIP + REWIND}"])).run()
    assert result.state_digest == reference.state_digest


def test_a_spike_that_recurs_after_every_rollback_fails_the_job_after_max_rollbacks_naming_the_steps(
    lc: LocalCluster,
) -> None:
    events: list[pb.JobEvent] = []
    with pytest.raises(JobError) as info:
        submit(compile_program(regression("unstable", lr=1.0)), endpoints=lc.endpoints, cluster=lc.keys.cluster,
               on_event=events.append, **SPIKES, max_rollbacks=2)
    rollbacks = details(events, "job.rolled_back")
    assert len(rollbacks) == 2, rollbacks
    steps = [d["spike"]["step"] for d in rollbacks]
    message = str(info.value)
    assert "the job rolled back 2 times already" in message and f"spikes at steps {steps[0]}, {steps[1]}" in message
    assert "max_rollbacks" in message and "before the spike, is kept (no commit past it)" in message, message
    spike_at = next(e.step for e in reversed(events) if e.event == "job.spike")
    store = lc.store()
    try:  # nothing the spike made can be resumed from
        assert all(c.step <= spike_at for c in read_commits(store, lc.keys, "unstable")["s"])
    finally:
        store.close()


def test_a_nan_batch_under_on_nonfinite_rollback_is_skipped_like_a_spike(lc: LocalCluster) -> None:
    events: list[pb.JobEvent] = []
    result = submit(compile_program(regression("nan-batch", poison=float("nan"))), endpoints=lc.endpoints,
                    cluster=lc.keys.cluster, on_event=events.append, on_nonfinite="rollback",
                    spike_rewind=REWIND, spike_skip=SKIP, keep_checkpoints=4)
    assert [(d["step"], d["action"]) for d in details(events, "job.nonfinite")] == [(POISON, "rollback")]
    assert [(d["cut"], d["skipped_steps"]) for d in details(events, "job.rolled_back")] == [
        (POISON - REWIND, [POISON - REWIND, POISON + SKIP])]
    reference = ReferenceExecutor(compile_program(regression("nan-batch", poison=float("nan"))),
                                  skips=Skips.parse([f"{POISON - REWIND}:{SKIP + REWIND}"])).run()
    assert result.state_digest == reference.state_digest
