"""Every reader of etcd records, fed random and truncated bytes (hypothesis): the parse functions refuse with
:class:`~rallypoint.etcd.records.BadRecord` and nothing else, and the readers of a prefix never raise, skip the
bad record, keep the good ones and count what they skipped (``rallypoint_bad_records_total``).

A malformed key used to raise from ``WorkerInfo.from_kv`` (not JSON, not an object, a bad ``pid``) and from
``read_cluster`` (``int()`` of a device index): the leader's membership thread died of one key.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rallypoint.etcd import records
from rallypoint.etcd.cluster_view import Holder, WorkerInfo, job_records, parse_job_records, read_cluster
from rallypoint.etcd.commits import CheckpointCommit, read_commits
from rallypoint.etcd.drains import DrainResult, read_drain_requests, read_drain_results
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.metrics_targets import read_metrics_targets
from rallypoint.etcd.records import BadRecord
from rallypoint.etcd.store import KeyValue, WatchBatch, WatchEvent
from rallypoint.orchestrator.control.membership import MembershipView
from rallypoint.orchestrator.job.runs import old_runs, previous_run
from rallypoint.orchestrator.job.stop import stop_request
from tests.fakes import FakeLog, MemoryStore

KEYS = Keys("fuzz")
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

GOOD_WORKER = json.dumps({"worker": "w1", "address": "127.0.0.1:1", "pid": 7, "devices": 2, "state": "serving"})
GOOD_HOLDER = json.dumps({"job": "j", "slice": "s", "nonce": "n", "term": 3})
GOOD_COMMIT = json.dumps({"job": "j", "slice": "s", "step": 4, "path": "/ck/4", "checksum": "sha256:00",
                          "states": ["params"]})

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
FIELDS = ["address", "pid", "devices", "state", "platform", "deterministic", "device_memory_bytes", "job", "slice",
          "nonce", "term", "step", "path", "checksum", "states", "reason", "by", "at", "deadline_s",
          "request_revision", "record", "metrics_address", "coordinator", "moves", "superseded_at", "action"]
# Records shaped like ours with fields of any type, JSON of any shape, random bytes, and good records cut short.
records_st = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.sampled_from([GOOD_WORKER, GOOD_HOLDER, GOOD_COMMIT]).flatmap(
        lambda g: st.integers(0, len(g)).map(lambda n: g[:n].encode())),
)
segments = st.one_of(st.sampled_from(["w1", "0", "1", "", "x", "-1", "١", "99999999999"]), st.text(max_size=5))


def _kv(key: str, value: bytes, rev: int = 5) -> KeyValue:
    return KeyValue(key=key, value=value, create_revision=rev, mod_revision=rev, version=1, lease=0)


@FUZZ
@given(value=records_st)
def test_each_parse_refuses_with_bad_record_only(value: bytes) -> None:
    parses = [
        lambda: WorkerInfo.from_kv("w1", _kv(KEYS.worker("w1"), value)),
        lambda: Holder.from_json(value, KEYS.lease("w1", 0)),
        lambda: CheckpointCommit.from_kv(_kv(KEYS.checkpoint("j", "s", 4), value)),
        lambda: DrainResult.from_json(value, KEYS.drain_result("w1", "j")),
        lambda: records.Fields(KEYS.job("j"), value, "job"),
    ]
    for parse in parses:
        try:
            parse()
        except BadRecord as exc:
            assert exc.key and exc.kind and str(exc)  # names the key and what to do
    stop_request(value.decode("utf-8", "replace"), FakeLog())  # None for a damaged key; it never raises


@FUZZ
@given(value=records_st, a=segments, b=segments)
def test_the_readers_of_a_prefix_skip_what_is_bad_and_keep_what_is_good(value: bytes, a: str, b: str) -> None:
    store = MemoryStore()
    store.put(KEYS.worker("good"), GOOD_WORKER)
    store.put(KEYS.device("good", 0), "{}")
    store.put(KEYS.lease("good", 0), GOOD_HOLDER)
    store.put(KEYS.checkpoint("j", "s", 4), GOOD_COMMIT)
    store.put(KEYS.job("j"), json.dumps({"state": "running"}))
    for key in (f"{KEYS.workers}{a}", f"{KEYS.devices}{a}/{b}", f"{KEYS.leases}{a}/{b}", f"{KEYS.cordons}{a}",
                f"{KEYS.lost_workers}{a}", f"{KEYS.drains}{a}", KEYS.drain_result("good", a or "j"),
                f"{KEYS.checkpoints('j')}{a}/{b}", f"{KEYS.jobs}{a or 'k'}", f"{KEYS.runs('j')}{a or 'r'}/record",
                KEYS.leader, f"{KEYS.coordinators}{a or 'c'}", KEYS.job_yields("j") + (a or "s")):
        store.put(key, value)
    snap = read_cluster(store, KEYS)
    if "good" in snap.workers:  # a garbage put at workers/good replaced the good record: nothing to keep then
        assert snap.workers["good"].devices == (0,) or f"{KEYS.devices}{a}/{b}" == f"{KEYS.devices}good/0"
    parse_job_records(store.get_prefix(KEYS.jobs)[0], KEYS)
    job_records(store, KEYS)
    commits = read_commits(store, KEYS, "j")
    assert all(isinstance(c, CheckpointCommit) for cs in commits.values() for c in cs)
    read_drain_requests(store, KEYS)
    read_drain_results(store, KEYS, "good", 1)
    read_metrics_targets(store, KEYS)
    previous_run(store, KEYS, "j", None)
    old_runs(store, KEYS, "j")
    view = MembershipView(KEYS)
    kvs, rev = store.get_prefix(KEYS.workers)
    view.resync(kvs, rev)
    view.apply(WatchBatch(rev + 1, [WatchEvent("put", _kv(f"{KEYS.workers}{a or 'w'}", value, rev + 1), None),
                                    WatchEvent("delete", _kv(f"{KEYS.workers}{a or 'w'}", b"", rev + 2),
                                               _kv(f"{KEYS.workers}{a or 'w'}", value, rev + 1))]))


@pytest.mark.parametrize("key,value", [
    (KEYS.worker("x"), b"not json"),
    (KEYS.worker("y"), b"[1, 2]"),
    (KEYS.worker("z"), json.dumps({"pid": "twelve"}).encode()),
    (f"{KEYS.devices}w1/notanint", b"{}"),
    (f"{KEYS.leases}w1/0", b"{\"job\": 1}"),
    (f"{KEYS.leases}w1/zero", json.dumps({"job": "j", "slice": "s"}).encode()),
])
def test_read_cluster_skips_one_bad_key_and_counts_it(key: str, value: bytes) -> None:
    store = MemoryStore()
    store.put(KEYS.worker("w1"), GOOD_WORKER)
    store.put(f"{KEYS.devices}w1/0", "{}")
    store.put(key, value)
    before = sum(records.bad_record_counts().values())
    snap = read_cluster(store, KEYS)  # raised ValueError (or KeyError) on main
    assert set(snap.workers) == {"w1"} and snap.workers["w1"].devices == (0,)
    assert sum(records.bad_record_counts().values()) == before + 1


def test_the_membership_view_skips_a_bad_record_and_keeps_tracking() -> None:
    view = MembershipView(KEYS)
    changes = view.resync([_kv(KEYS.worker("x"), b"garbage", 2), _kv(KEYS.worker("w1"), GOOD_WORKER.encode(), 3)], 3)
    assert [(c.kind, c.worker) for c in changes] == [("registered", "w1")]  # raised ValueError on main
    changes = view.apply(WatchBatch(5, [WatchEvent("put", _kv(KEYS.worker("y"), b"{\"pid\": []}", 4), None),
                                        WatchEvent("put", _kv(KEYS.worker("w2"), GOOD_WORKER.encode(), 5), None)]))
    assert [(c.kind, c.worker) for c in changes] == [("registered", "w2")]


def test_the_coordinators_metrics_name_the_count() -> None:
    records.report(BadRecord("k", "fuzz-kind", "why"))
    fam: Any = records.bad_records_metric()
    samples = {s.labels["kind"]: s.value for s in fam.samples if s.name == "rallypoint_bad_records_total"}
    assert samples["fuzz-kind"] >= 1
