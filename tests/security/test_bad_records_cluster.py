"""Malformed records in a real cluster's etcd (real TLS, etcd auth, a real coordinator and worker processes):
the leader logs, counts and skips them, and keeps tracking membership.

Before, one malformed ``workers/<id>`` value killed the leader's membership thread in silence (again at the
first resync of every new leader), and one ``devices/<w>/<not an int>`` key made every ``read_cluster`` raise
(placement, ``SubmitJob``, the metrics scrape).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rallypoint.cluster.local import LocalCluster, LocalClusterConfig, is_running
from tests.conftest import read_events, wait_until

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def lc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cfg = LocalClusterConfig(state_dir=tmp_path_factory.mktemp("bad-records"), workers=1, spares=0,
                             devices_per_worker=1, coordinators=1, lease_ttl_s=2)
    cluster = LocalCluster.start(cfg)
    try:
        yield cluster
    finally:
        cluster.stop()
        assert not [p for p in cluster.processes if is_running(p)]


def _scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_the_leader_skips_bad_records_and_still_sees_a_worker_join(lc: LocalCluster) -> None:
    store = lc.store()
    try:
        leader = wait_until(lambda: store.get(lc.keys.leader), 30, "a leader elected").json()["coordinator"]
        log = lc.process(leader).log
        wait_until(lambda: read_events(log, "leader.elected"), 30, "the leader's membership watch started")
        for key, value in [(lc.keys.worker("x"), "not json"), (lc.keys.worker("y"), "[1, 2]"),
                           (lc.keys.worker("z"), json.dumps({"pid": "twelve"})),
                           (f"{lc.keys.devices}w9/notanint", "{}"), (f"{lc.keys.leases}w9/0", '{"job": 1}')]:
            store.put(key, value)
        lc.spawn("worker", "w1")  # a real worker joining after the garbage (its start takes seconds: JAX)
        joined = wait_until(lambda: [e for e in read_events(log, "worker.joined") if e.get("worker") == "w1"], 60,
                            "the leader tracking w1's registration (on main its membership thread had died)")
        assert joined
        assert len(read_events(log, "record.bad")) >= 3  # each bad worker record, logged with its key
        assert not read_events(log, "membership.watch_failed")
        target = next(t for t in lc.metrics_targets() if t["role"] == "coordinator")
        m = wait_until(lambda: _scrape(target["address"]), 10, "a metrics scrape")  # read_cluster inside: raised
        assert m[("rallypoint_workers", (("state", "spare"),))] == 2.0  # w0 and w1; the garbage left out
        bad = {dict(k[1])["kind"]: v for k, v in m.items() if k[0] == "rallypoint_bad_records_total"}
        assert bad.get("worker", 0) >= 3 and bad.get("device", 0) >= 1 and bad.get("holder", 0) >= 1, bad
    finally:
        for key in (lc.keys.worker("x"), lc.keys.worker("y"), lc.keys.worker("z"), f"{lc.keys.devices}w9/notanint",
                    f"{lc.keys.leases}w9/0"):
            store.delete(key)
        store.close()
