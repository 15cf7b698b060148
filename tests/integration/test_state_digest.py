"""The state digest means the same in every process: a ``TrainState`` job's reference run made in two
processes, and its run on a real cluster (the coordinator's digest), all agree."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

from rallypoint.client.compile import compile_program
from rallypoint.client.submission import submit
from rallypoint.cluster.local import LocalCluster
from tests.helpers import train_state_job
from tests.helpers.cli import ROOT


def _reference_in_a_new_process() -> str:
    out = subprocess.run([sys.executable, "-m", "tests.helpers.train_state_job"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_a_train_state_jobs_reference_digest_is_the_same_in_two_processes_and_on_the_cluster(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    first, second = _reference_in_a_new_process(), _reference_in_a_new_process()
    assert first == second and len(first) == 64
    lc = local_cluster(workers=1, spares=0, coordinators=1)
    events: list[dict] = []
    result = submit(compile_program(train_state_job.build()), endpoints=lc.endpoints, cluster=lc.keys.cluster,
                    on_event=lambda ev: events.append({"event": ev.event, **json.loads(ev.detail or "{}")}))
    coordinator = next(e["state_digest"] for e in events if e["event"] == "job.finished")
    assert result.state_digest == coordinator == first
