"""Liveness with real processes and real signals: death, hangs, zombies, re-registration."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from rallypoint.orchestrator.control.devices import DeviceLeases

from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.basics.authz import COORDINATOR
from rallypoint.basics.errors import StoreError
from rallypoint.basics.tls import channel as tls_channel
from rallypoint.cluster.certs import issue
from rallypoint.cluster.local import LocalCluster
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc
from tests.conftest import read_events, wait_until


def _leader_log(lc: LocalCluster) -> str:
    store = lc.store()
    try:
        leader = store.get(lc.keys.leader)
    finally:
        store.close()
    assert leader is not None, "no coordinator leads"
    return lc.process(leader.json()["coordinator"]).log


def _leader_events(lc: LocalCluster, event: str) -> list[dict[str, Any]]:
    """The leader's ``event`` records; none while no coordinator leads yet (an election under load takes a while)."""
    store = lc.store()
    try:
        leader = store.get(lc.keys.leader)
    finally:
        store.close()
    return read_events(lc.process(leader.json()["coordinator"]).log, event) if leader is not None else []


def test_killed_worker_is_fenced_through_the_broken_connection_and_its_devices_freed(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    lc = local_cluster(workers=2, devices_per_worker=2, lease_ttl_s=4)
    store = lc.store()
    try:
        placement = DeviceLeases(store, lc.keys).allocate("job1", "stage0", 2)
        victim = placement.worker
        wait_until(lambda: _leader_events(lc, "worker.joined"), 10, "leader links to workers")
        lc.signal(victim, signal.SIGKILL)
        lost = wait_until(lambda: store.get(lc.keys.lost(victim)), 4, f"{victim} recorded lost").json()
        # The TTL is 4 s: a loss recorded well before it came from the broken stream, and the
        # record says so.
        assert lost["reason"] == "connection_lost"
        assert lost["incarnation"] == placement.incarnation
        snap = read_cluster(store, lc.keys)
        assert victim not in snap.workers
        assert not [k for k in store.get_prefix(lc.keys.worker_leases(victim))[0]], "devices still leased"
        # The leader writes the record, then logs it: the record can be read before the line is written.
        events = wait_until(lambda: read_events(_leader_log(lc), "worker.lost"), 5, "the loss in the leader's log")
        assert [e["worker"] for e in events] == [victim]
        assert read_events(_leader_log(lc), "lease.revoked")[0]["worker"] == victim
    finally:
        store.close()


def test_stopped_worker_is_lost_refuses_everything_on_resume_and_registers_a_new_incarnation(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    lc = local_cluster(workers=2, lease_ttl_s=1, suspect_after_s=0)  # the lease path alone
    store = lc.store()
    try:
        snap = read_cluster(store, lc.keys)
        info = snap.workers["w1"].info
        old = info.incarnation
        channel = tls_channel(info.address, lc.client_tls)
        stub = pb_grpc.WorkerStub(channel)
        ident = pb.Identity(cluster=lc.keys.cluster, worker_id="w1", incarnation=old)
        assert stub.Ping(pb.PingRequest(to=ident), timeout=2).incarnation == old

        lc.signal("w1", signal.SIGSTOP)
        lost = wait_until(lambda: store.get(lc.keys.lost("w1")), 6, "w1 recorded lost").json()
        assert lost["reason"] == "lease_expired" and lost["incarnation"] == old

        # Hammer the zombie with requests for its old incarnation from before it resumes
        # until it has re-registered: not one may be served.
        answered_old: list[int] = []
        refused: list[str] = []
        stop = threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                try:
                    r = stub.Ping(pb.PingRequest(to=pb.Identity(worker_id="w1")), timeout=0.2)
                    if r.incarnation == old:
                        answered_old.append(r.incarnation)
                except grpc.RpcError as exc:
                    if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                        refused.append(exc.details() or "")

        t = threading.Thread(target=hammer)
        t.start()
        try:
            lc.signal("w1", signal.SIGCONT)
            new = wait_until(
                lambda: (kv := store.get(lc.keys.worker("w1"))) and kv.create_revision != old and kv.create_revision,
                10, "w1 re-registered",
            )
            stop.wait(0.3)
        finally:
            stop.set()
            t.join()
        channel.close()
        assert answered_old == [], "the zombie acted under its old incarnation"
        assert new > old
        log = lc.process("w1").log
        fenced = read_events(log, "worker.fenced")
        registered = read_events(log, "worker.registered")
        assert fenced and fenced[-1]["incarnation"] == old
        assert [r["incarnation"] for r in registered] == [old, new]
        # The new incarnation is served; the old one is refused by name.
        channel = tls_channel(info.address, lc.client_tls)
        stub = pb_grpc.WorkerStub(channel)
        assert stub.Ping(pb.PingRequest(to=pb.Identity(incarnation=new)), timeout=2).incarnation == new
        try:
            stub.Ping(pb.PingRequest(to=pb.Identity(incarnation=old)), timeout=2)
            raise AssertionError("a request for the old incarnation was served")
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "incarnation" in (exc.details() or "")
        channel.close()
        # The coordinator saw it come back.
        joined = [e for e in read_events(_leader_log(lc), "worker.joined") if e["worker"] == "w1"]
        assert [e["incarnation"] for e in joined][-1] == new
    finally:
        store.close()


def test_a_silent_worker_is_fenced_well_before_its_lease_ttl_and_comes_back_as_a_new_incarnation(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    lc = local_cluster(workers=2, lease_ttl_s=6, suspect_after_s=1.0)
    store = lc.store()
    try:
        old = read_cluster(store, lc.keys).workers["w1"].info.incarnation
        wait_until(lambda: len(_leader_events(lc, "worker.joined")) >= 2, 10, "leader links")
        t0 = time.monotonic()
        lc.signal("w1", signal.SIGSTOP)
        lost = wait_until(lambda: store.get(lc.keys.lost("w1")), 6, "w1 recorded lost").json()
        fenced_s = time.monotonic() - t0
        # Its lease had 6 s to run: the heartbeats' silence found it, and the leader fenced it.
        assert lost["reason"] == "silent" and lost["incarnation"] == old
        assert fenced_s < 4.0, f"fenced after {fenced_s:.2f}s: the silence was not acted on"
        (silent,) = [e for e in read_events(_leader_log(lc), "worker.silent") if e["worker"] == "w1"]
        assert 1.0 <= silent["silent_s"] < 2.0
        assert "w1" not in read_cluster(store, lc.keys).workers
        lc.signal("w1", signal.SIGCONT)
        new = wait_until(lambda: (kv := store.get(lc.keys.worker("w1"))) and kv.create_revision != old
                         and kv.create_revision, 15, "w1 re-registered")
        assert new > old
        assert "w0" in read_cluster(store, lc.keys).workers and not store.get(lc.keys.lost("w0"))
    finally:
        store.close()


def test_a_coordinator_that_was_itself_stopped_suspects_nobody_for_its_own_pause(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    lc = local_cluster(workers=2, coordinators=1, lease_ttl_s=6, suspect_after_s=1.0)
    store = lc.store()
    try:
        before = {w: s.info.incarnation for w, s in read_cluster(store, lc.keys).workers.items()}
        wait_until(lambda: len(_leader_events(lc, "worker.joined")) >= 2, 10, "leader links")
        lc.signal("c0", signal.SIGSTOP)  # the leader freezes for 2.5 s; its lease (6 s) outlives the pause
        time.sleep(2.5)
        lc.signal("c0", signal.SIGCONT)
        # Heartbeats it had not read arrive now; nobody may be called silent for that. To know the watch is
        # back at work (rather than waiting a while and seeing nothing), w0 now goes silent for real: once the
        # leader has called w0 silent, it has looked at w1 after the pause as well, with older heartbeats.
        resumed = time.monotonic()
        lc.signal("w0", signal.SIGSTOP)
        silent = wait_until(lambda: read_events(lc.process("c0").log, "worker.silent"), 10, "w0 called silent")
        noticed_s = time.monotonic() - resumed
        assert [e["worker"] for e in silent] == ["w0"], silent
        assert 1.0 <= silent[0]["silent_s"] <= noticed_s + 0.1, (silent, noticed_s)  # w0's silence, not the pause
        assert [kv.key for kv in store.get_prefix(lc.keys.lost_workers)[0]] in ([], [lc.keys.lost("w0")])
        after = {w: s.info.incarnation for w, s in read_cluster(store, lc.keys).workers.items()}
        assert after.get("w1") == before["w1"] and after.get("w0") in (None, before["w0"]), (before, after)
    finally:
        store.close()


def test_etcd_down_for_longer_than_the_ttl_loses_no_healthy_worker(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    lc = local_cluster(workers=2, lease_ttl_s=2)
    assert lc.etcd is not None
    store = lc.store()
    try:
        before = {w: s.info.incarnation for w, s in read_cluster(store, lc.keys).workers.items()}
        wait_until(lambda: len(_leader_events(lc, "worker.joined")) >= 2, 10, "leader links")
        leader_before = store.get(lc.keys.leader)
        lc.etcd.stop_member(0)
        threading.Event().wait(3.5)  # longer than the 2 s TTL
        lc.etcd.start_member(0)
        # Leases survive an etcd restart (the new etcd leader refreshes them): each worker's keepalives failed
        # in the outage and one has been acknowledged since (its lease is alive and renewed).
        wait_until(lambda: _try_read(lc), 10, "etcd back")
        wait_until(lambda: all(read_events(lc.process(w).log, "lease.keepalive_failed")
                               and read_events(lc.process(w).log, "lease.recovered") for w in ("w0", "w1")),
                   15, "every worker's lease kept alive again")
        after = {w: s.info.incarnation for w, s in read_cluster(store, lc.keys).workers.items()}
        assert after == before, "a worker lost its incarnation over an etcd outage"
        assert store.get_prefix(lc.keys.lost_workers)[0] == []
        for p in lc.processes:
            if p.role != "etcd":
                assert not read_events(p.log, "worker.lost"), f"{p.name} declared a worker lost"
                assert all(e.get("level") != "critical" for e in read_events(p.log))
        from rallypoint.cluster.local import is_running

        assert all(is_running(p) for p in lc.processes if p.role != "etcd"), "a process died"
        # The outage was seen (retries were logged, above), and the cluster leads again.
        # The leader only stepped back on its local deadline and kept its lease, which etcd
        # refreshed: it resumes the same term instead of forcing an election.
        leader_after = wait_until(lambda: store.get(lc.keys.leader), 10, "a leader again")
        assert leader_before is not None
        assert leader_after.create_revision == leader_before.create_revision
    finally:
        store.close()


def _try_read(lc: LocalCluster) -> bool:
    s = lc.store()
    try:
        s.get(lc.keys.leader)
        return True
    except StoreError:
        return False
    finally:
        s.close()


def test_three_member_etcd_survives_a_member_loss_and_still_detects_a_dead_worker(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    lc = local_cluster(workers=2, coordinators=2, etcd_members=3, lease_ttl_s=2)
    assert lc.etcd is not None and len(lc.endpoints) == 3
    wait_until(lambda: len(_leader_events(lc, "worker.joined")) >= 2, 10, "leader links")
    lc.etcd.kill_member(0)
    store = lc.store()
    try:
        lc.signal("w0", signal.SIGKILL)
        lost = wait_until(lambda: _get_or_none(store, lc.keys.lost("w0")), 10, "w0 recorded lost").json()
        assert lost["reason"] in ("connection_lost", "lease_expired")
        assert "w1" in read_cluster(store, lc.keys).workers
    finally:
        store.close()


def _get_or_none(store, key):  # type: ignore[no-untyped-def]
    try:
        return store.get(key)
    except StoreError:
        return None  # a request routed to the dead member; the next one goes elsewhere


def test_a_worker_refuses_requests_from_a_coordinator_term_older_than_one_it_obeyed(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    lc = local_cluster(workers=1, coordinators=1)
    store = lc.store()
    try:
        info = read_cluster(store, lc.keys).workers["w0"].info
    finally:
        store.close()
    assert lc.tls_dir is not None  # only a coordinator's term moves a worker's newest (tests/security/)
    leader_cert = issue(lc.tls_dir, "probe-coordinator", role=COORDINATOR, cluster=lc.keys.cluster)
    channel = tls_channel(info.address, leader_cert)
    try:
        stub = pb_grpc.WorkerStub(channel)
        newer = 10**9  # a term newer than the running leader's
        assert stub.Ping(pb.PingRequest(to=pb.Identity(incarnation=info.incarnation, term=newer)), timeout=2)
        try:
            stub.Ping(pb.PingRequest(to=pb.Identity(incarnation=info.incarnation, term=newer - 1)), timeout=2)
            raise AssertionError("a request from an older term was served")
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert f"term {newer - 1} refused, term {newer} already leads" in (exc.details() or "")
        # Requests that name no term (worker to worker transfers) are not term-fenced.
        assert stub.Ping(pb.PingRequest(to=pb.Identity(incarnation=info.incarnation)), timeout=2)
    finally:
        channel.close()
