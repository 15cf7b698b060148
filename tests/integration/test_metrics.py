"""Prometheus metrics of a live local cluster: scraped over HTTP while a job runs through a SIGKILL.

Every number is checked against what the job itself reports (its ``job.finished``
summary, its status record): steps, recoveries, replays, the goodput buckets, a
surviving worker's instances, compute seconds and checkpoint commits (docs/metrics.md).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rallypoint.client.compile import CompiledProgram
from rallypoint.client.commands.faults import Fault
from rallypoint.cluster.local import LocalCluster
from rallypoint.proto import rallypoint_pb2 as pb
from tests.helpers.cli import rp
from tests.helpers.cluster import EVERY, STEPS, assert_settled, run

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str) -> Samples:
    """Every sample of the endpoint: ``(name, sorted labels) -> value``."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"no sample {name}{labels}; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


def instances_of(compiled: CompiledProgram, slice_name: str) -> int:
    prog = compiled.program
    return sum((prog.microbatches if n.per == "microbatch" else 1) * len(range(0, STEPS, max(n.every, 1)))
               for n in prog.nodes.values() if n.slice == slice_name)


def test_a_scrape_of_the_leader_and_a_worker_matches_the_job_through_a_kill(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],  # noqa: F811
) -> None:
    compiled, reference = pipeline
    job = compiled.program.name
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=2)
    targets = lc.metrics_targets()
    leaders = [t for t in targets if t["leader"]]
    assert len(leaders) == 1 and sum(t["role"] == "worker" for t in targets) == 5, targets
    leader = leaders[0]["address"]
    standby = next(t["address"] for t in targets if t["role"] == "coordinator" and not t["leader"])
    before = scrape(leader)
    assert value(before, "rallypoint_coordinator_leader") == 1.0
    assert value(before, "rallypoint_workers", state="spare") == 5.0
    assert value(before, "rallypoint_devices", state="free") == 5.0
    s = scrape(standby)
    assert value(s, "rallypoint_coordinator_leader") == 0.0
    assert not any(k[0] == "rallypoint_workers" for k in s), "a standby must not count the cluster too"

    during: dict[str, Any] = {}

    def on_event(ev: pb.JobEvent) -> None:
        if ev.event == "step.done" and ev.step == 3 and not during:
            during.update(scrape(leader))

    result, injector = run(lc, compiled, [Fault("stage2", "stage2", 12)], on_event=on_event)
    assert result.state_digest == reference
    rec = result.recovery
    (r,) = rec["recoveries"]

    # While it ran, it held one device per slice.
    assert value(during, "rallypoint_device_leases", job_name=job) == 4.0
    assert value(during, "rallypoint_workers", state="leased") == 4.0
    assert value(during, "rallypoint_job_state", job_name=job, state="running") == 1.0

    m = scrape(leader)
    assert value(m, "rallypoint_job_state", job_name=job, state="succeeded") == 1.0
    assert value(m, "rallypoint_job_state", job_name=job, state="running") == 0.0
    assert value(m, "rallypoint_job_steps_completed_total", job_name=job) == STEPS
    assert value(m, "rallypoint_job_step", job_name=job) == STEPS
    assert value(m, "rallypoint_job_steps_per_second", job_name=job) > 0
    assert value(m, "rallypoint_job_recoveries_total", job_name=job) == 1.0
    replayed_instances = sum(rec["replayed_instances"].values())
    assert value(m, "rallypoint_job_replayed_instances_total", job_name=job) == replayed_instances
    # Each of the job's slices has a step time for every step (first runs).
    for sl in ("stage0", "stage1", "stage2", "stage3"):
        assert value(m, "rallypoint_job_step_seconds_count", job_name=job, slice=sl) == STEPS
    # The recovery's phases and MTTR, as job.finished reports them.
    for phase, secs in r["phases"].items():
        assert value(m, "rallypoint_job_recovery_phase_seconds_count", job_name=job, phase=phase) == 1.0
        assert value(m, "rallypoint_job_recovery_phase_seconds_sum", job_name=job, phase=phase) == \
            pytest.approx(secs, abs=1e-3)
    assert value(m, "rallypoint_job_mttr_seconds_count", job_name=job) == 1.0
    assert value(m, "rallypoint_job_mttr_seconds_sum", job_name=job) == pytest.approx(r["mttr_s"], abs=2e-3)
    # The goodput buckets (docs/metrics.md) against the job's own compute counts.
    productive = value(m, "rallypoint_goodput_seconds_total", job_name=job, bucket="productive")
    replayed = value(m, "rallypoint_goodput_seconds_total", job_name=job, bucket="replayed")
    recovery = value(m, "rallypoint_goodput_seconds_total", job_name=job, bucket="recovery")
    waiting = value(m, "rallypoint_goodput_seconds_total", job_name=job, bucket="waiting_for_spares")
    assert productive == pytest.approx(sum(rec["compute_s"].values()), abs=1e-3 * len(rec["compute_s"]))
    assert replayed == pytest.approx(rec["redone_s"], abs=1e-3)
    assert (replayed > 0) == (replayed_instances > 0)
    assert waiting == 0.0 and r["spare_wait_s"] == 0.0  # a spare was there
    assert 0 < recovery == pytest.approx(r["mttr_s"], abs=2e-3)
    assert value(m, "rallypoint_goodput_ratio", job_name=job) == pytest.approx(productive / (productive + replayed))
    assert_settled(lc)
    after = scrape(leader)
    assert not any(k[0] == "rallypoint_device_leases" for k in after), "leases outlived the job"
    assert value(after, "rallypoint_workers", state="lost") == 1.0

    # A surviving worker: what it ran, its checkpoints, its pushes.
    status = json.loads(rp("status", "--json", "--cluster", f"{lc.keys.cluster}@{lc.endpoints[0]}",
                           "--tls-dir", str(lc.tls_dir), job).stdout)
    survivor = status["placement"]["stage0"]["worker"]
    listed = rp("metrics", "--json", "--cluster", f"{lc.keys.cluster}@{lc.endpoints[0]}", "--tls-dir", str(lc.tls_dir))
    rows = {row["name"]: row for row in map(json.loads, listed.stdout.splitlines())}
    assert injector.fired[0]["worker"] not in rows and survivor in rows
    w = scrape(rows[survivor]["address"])
    assert value(w, "rallypoint_worker_state", state="serving") == 1.0
    assert value(w, "rallypoint_worker_incarnation") > 0
    assert value(w, "rallypoint_worker_instances_total", job_name=job) == instances_of(compiled, "stage0")
    stage0_compute = sum(v for n, v in rec["compute_s"].items() if compiled.program.nodes[n].slice == "stage0")
    assert value(w, "rallypoint_worker_compute_seconds_total", job_name=job) == pytest.approx(stage0_compute, abs=5e-3)
    commits = value(w, "rallypoint_worker_checkpoint_commit_seconds_count", job_name=job)
    assert 1 <= commits <= len(range(EVERY, STEPS, EVERY)) + 1  # the schedule's, and the final cut
    assert value(w, "rallypoint_worker_checkpoint_save_seconds_count", job_name=job) >= commits
    blocking = value(w, "rallypoint_goodput_seconds_total", job_name=job, bucket="checkpoint_blocking")
    assert 0 < blocking == pytest.approx(
        value(w, "rallypoint_worker_checkpoint_blocking_seconds_sum", job_name=job))
    assert value(w, "rallypoint_worker_transfer_bytes_total", direction="sent") > 0  # activations to stage1
    assert value(w, "rallypoint_worker_transfer_bytes_total", direction="received") > 0  # gradients from stage1
    assert value(w, "rallypoint_worker_jobs_loaded") == 0.0
