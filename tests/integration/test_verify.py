"""Silent data corruption caught on a real local cluster (docs/integrity.md): real etcd, real worker processes,
real Orbax checkpoints, and a worker whose ``corrupt`` fault hook flips one bit of the slice's state at every
step from ``BAD_FROM`` on (workers/corruption.py: a hook only a worker started for tests has).

One job of one slice on w0, two idle workers (w1, w2), a verification at every cut. The verification of the
steps that w0 computed wrong does not match its commit; the third worker sides with the verifier; w0 is
convicted and cordoned ``suspect-sdc``, the job goes back to the last cut a verification confirmed and runs on
the verifier's side, and it ends bitwise equal to the in-process reference. (A verification's parts without a
cluster: tests/orchestrator/test_verify.py.)
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from rallypoint.client.commands.jobs import integrity_lines, job_status
from rallypoint.client.commands.main import worker_rows
from rallypoint.client.compile import compile_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.submission import submit
from rallypoint.cluster.local import LocalCluster
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.faults import WorkerFaults
from tests.helpers.regression import regression

BAD_FROM = 5


def details(events: list[pb.JobEvent], name: str) -> list[dict[str, Any]]:
    return [{"step": e.step, **json.loads(e.detail)} for e in events if e.event == name]


def test_a_worker_that_corrupts_its_state_is_caught_by_a_verification_cordoned_and_the_run_ends_exact(
    local_cluster: Callable[..., LocalCluster], tmp_path: Path,
) -> None:
    flag = tmp_path / "corrupt.json"
    flag.write_text(json.dumps({"slice": "s", "step": BAD_FROM, "mode": "persist", "worker": "w0"}))
    lc = local_cluster(workers=1, spares=2, coordinators=1, worker_faults=WorkerFaults(corrupt_flag=str(flag)))
    events: list[pb.JobEvent] = []
    compiled = compile_program(regression("sdc-caught", poison=1.0))
    result = submit(compiled, endpoints=lc.endpoints, cluster=lc.keys.cluster, on_event=events.append,
                    verify_every=1, warm_spares=0)
    assert result.state_digest == ReferenceExecutor(compiled).run().state_digest  # exact, through the conviction
    (mismatch, *_) = details(events, "job.verify_mismatch")
    assert mismatch["primary"] == "w0" and mismatch["checksum"] != mismatch["primary_checksum"], mismatch
    (sdc,) = [d for d in details(events, "job.sdc") if d["verdict"] == "convicted"]
    assert sdc["suspect"] == "w0" and sdc["third"]["checksum"] == mismatch["checksum"], sdc
    assert sdc["trusted_cut"] < BAD_FROM + 1
    recovering = details(events, "job.recovering")
    assert any("suspect-sdc" in why for d in recovering for why in d["lost"].values()), recovering
    assert details(events, "job.verified"), "no verification matched (the final state's, at least)"
    store = lc.store()
    try:
        snap = read_cluster(store, lc.keys)
        assert snap.cordoned == frozenset({"w0"}) and snap.workers["w0"].cordoned_by == "suspect-sdc"
        (row,) = [r for r in worker_rows(snap) if r["worker"] == "w0"]  # `rallypoint workers`
        assert row["state"] == "cordoned" and row["cordoned_by"] == "suspect-sdc", row
        cordon = json.loads(store.get(lc.keys.cordon("w0")).value)
        assert cordon["by"] == "suspect-sdc" and cordon["slice"] == "s", cordon
        record = store.get(lc.keys.job("sdc-caught")).json()
        assert record["placement"]["s"]["worker"] != "w0"
        assert [m["verdict"] for m in record["verifications"]["mismatches"]] == ["convicted"]
        lines = integrity_lines(job_status(store, lc.keys, "sdc-caught"))  # `rallypoint status`
        assert any("mismatch on slice s" in x and "convicted, suspect w0" in x for x in lines), lines
    finally:
        store.close()
    (leader,) = [t["address"] for t in lc.metrics_targets() if t["leader"]]
    with urllib.request.urlopen(f"http://{leader}/metrics", timeout=10) as r:
        samples = {(m.name, tuple(sorted(m.labels.items()))): m.value
                   for fam in text_string_to_metric_families(r.read().decode()) for m in fam.samples}
    checks = {v: samples[("rallypoint_job_verifications_total", (("job_name", "sdc-caught"), ("verdict", v)))]
              for v in ("matched", "mismatched", "convicted")}
    assert checks["convicted"] == 1 and checks["mismatched"] == 1 and checks["matched"] >= 1, checks
