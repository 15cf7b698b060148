"""A stolen worker certificate writes only its own worker's keys; commits count only once the leader checked them.

A real etcd with TLS and auth (the users :func:`rallypoint.etcd.auth.enable_auth` makes, one per
worker), real certificates from ``rallypoint certs``' code: the test holds worker ``wa``'s
certificate, as an attacker would, and tries each write that let one worker take over others.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rallypoint.basics.authz import COORDINATOR, ETCD, OPERATOR, WORKER, etcd_user
from rallypoint.basics.errors import StoreError
from rallypoint.basics.tls import TlsConfig
from rallypoint.cluster.certs import issue
from rallypoint.etcd.auth import ROOT_PASSWORD_FILE, add_worker_user, enable_auth
from rallypoint.etcd.commits import CheckpointCommit, read_commits
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.server import EtcdCluster
from rallypoint.etcd.store import Put, created_at
from rallypoint.orchestrator.job.promote import promote, promote_pending
from rallypoint.recovery.load_plan import SlicePlace
from rallypoint.workers.checkpoints.committer import etcd_commit

pytestmark = pytest.mark.processes

K = Keys("sec")


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, what: str, **kw: Any) -> None:
        self.lines.append((what, kw))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("etcd-ids")
    tls = d / "tls"
    etcd_tls = issue(tls, "etcd", role=ETCD)
    certs = {n: issue(tls, n, role=r) for n, r in
             (("c0", COORDINATOR), ("op", OPERATOR), ("wa", WORKER), ("wb", WORKER), ("wc", WORKER))}
    etcd = EtcdCluster.start(members=1, base_dir=d / "etcd", tls=etcd_tls)
    try:
        enable_auth(etcd.endpoints, certs["op"], K.prefix, secrets_dir=d / "secrets", workers=["wa", "wb"])
        yield {"etcd": etcd, "certs": certs, "dir": d}
    finally:
        etcd.stop()


@pytest.fixture(scope="module")
def stores(cluster: dict[str, Any]) -> Iterator[dict[str, EtcdStore]]:
    out = {n: EtcdStore(cluster["etcd"].endpoints, tls=t, request_timeout_s=3) for n, t in cluster["certs"].items()}
    try:
        yield out
    finally:
        for s in out.values():
            s.close()


def register(store: EtcdStore, worker: str, address: str) -> tuple[int, int]:
    """What a worker's registration writes (workers/registration.py): its record and a device, on its own lease."""
    lease = store.grant_lease(30).id
    r = store.txn([], [Put(K.worker(worker), json.dumps({"address": address, "devices": 1}), lease=lease),
                       Put(K.device(worker, 0), "{}", lease=lease)])
    assert r.succeeded
    kv = store.get(K.worker(worker))
    assert kv is not None
    return lease, kv.create_revision


def refused(fn: Any) -> None:
    with pytest.raises(StoreError, match="PERMISSION_DENIED|permission denied"):
        fn()


def test_a_worker_certificate_names_its_worker_and_its_own_etcd_user(cluster: dict[str, Any]) -> None:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(cluster["certs"]["wa"].cert.read_bytes())
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert cn == etcd_user("rallypoint", WORKER, "wa") == "rallypoint-worker-wa"
    assert "rallypoint://worker/wa" in san.get_values_for_type(x509.UniformResourceIdentifier)
    assert "wa.worker.rallypoint" in san.get_values_for_type(x509.DNSName)
    days = (cert.not_valid_after_utc - cert.not_valid_before_utc).days
    assert days <= 91  # was 825: nothing revokes a certificate, so it ends soon


def test_a_worker_writes_its_own_keys_and_no_other_workers(stores: dict[str, EtcdStore]) -> None:
    wa, wb, c0 = stores["wa"], stores["wb"], stores["c0"]
    lease_b, _inc_b = register(wb, "wb", "10.0.0.2:1")
    lease_a, _inc_a = register(wa, "wa", "10.0.0.1:1")  # its own registration, devices, cordon and drain
    wa.put(K.cordon("wa"), "{}", lease=lease_a)
    wa.put(K.drain("wa"), "{}", lease=lease_a)
    # Another worker's address (the leader would dial the attacker), devices, cordon, drain.
    for key in (K.worker("wb"), K.device("wb", 0), K.cordon("wb"), K.drain("wb"), K.worker("wa0"),
                K.cordon("wa0"), K.worker("w9")):
        refused(lambda key=key: wa.put(key, json.dumps({"address": "10.6.6.6:1"})))
    refused(lambda: wa.delete(K.worker("wb")))
    refused(lambda: wa.revoke_lease(lease_b))  # every worker's lease was revocable by any worker
    assert json.loads(c0.get(K.worker("wb")).value)["address"] == "10.0.0.2:1"  # type: ignore[union-attr]
    # Device leases are the leader's, job records and commits too.
    for key in (K.lease("wb", 0), K.lease("wa", 0), K.job("j"), K.old_run("j", "fake") ,
                K.checkpoint("j", "s", 10), K.worker_commit("wb", "j", "s", 10), K.lost("wb")):
        refused(lambda key=key: wa.put(key, json.dumps({"superseded_at": 9e18})))
    wa.revoke_lease(lease_a)  # its own lease carries only its own keys: it may still leave cleanly
    assert c0.get(K.worker("wa")) is None and c0.get(K.cordon("wa")) is None


def test_an_unknown_worker_or_a_worker_without_an_id_writes_nothing(cluster: dict[str, Any],
                                                                    stores: dict[str, EtcdStore]) -> None:
    # wc's certificate was made but its etcd user not added: nothing; a shared `rallypoint-worker` reads only.
    with pytest.raises(StoreError):
        stores["wc"].put(K.worker("wc"), "{}")
    add_worker_user(cluster["etcd"].endpoints, cluster["certs"]["op"], K.prefix, "wc",
                    root_password=(cluster["dir"] / "secrets" / ROOT_PASSWORD_FILE).read_text().strip())
    stores["wc"].put(K.worker("wc"), "{}")  # now its own key, and still no other
    refused(lambda: stores["wc"].put(K.worker("wa"), "{}"))
    stores["c0"].delete(K.worker("wc"))


def test_device_leases_hang_on_the_leaders_lease_and_the_leader_frees_a_lost_workers(
        stores: dict[str, EtcdStore]) -> None:
    from rallypoint.orchestrator.control.devices import DeviceLeases, free_worker

    wb, c0 = stores["wb"], stores["c0"]
    lease_b, _ = register(wb, "wb", "10.0.0.2:1")
    leader_lease = c0.grant_lease(30).id
    leases = DeviceLeases(c0, K, lease=lambda: leader_lease)
    p = leases.lease("j", "s", "wb", [0])
    assert p is not None and c0.get(K.lease("wb", 0)).lease == leader_lease  # type: ignore[union-attr]
    wb.revoke_lease(lease_b)  # the worker may still revoke its own lease: no leader key is on it
    gone = c0.get_prefix(K.prefix)[1]
    assert c0.get(K.lease("wb", 0)) is not None  # ... and its device lease outlives it until the leader frees it
    assert free_worker(c0, K, c0.txn, "wb", gone + 1) == 1
    assert c0.get(K.lease("wb", 0)) is None
    c0.revoke_lease(leader_lease)


def places(worker: str, inc: int) -> dict[str, SlicePlace]:
    return {"s": SlicePlace(worker=worker, address="x", incarnation=inc, devices=(0,))}


def test_a_forged_commit_is_not_promoted_and_a_genuine_one_is(cluster: dict[str, Any],
                                                               stores: dict[str, EtcdStore], tmp_path: Path) -> None:
    wa, wb, c0 = stores["wa"], stores["wb"], stores["c0"]
    lease_a, inc_a = register(wa, "wa", "10.0.0.1:1")
    lease_b, inc_b = register(wb, "wb", "10.0.0.2:1")
    run = tmp_path / "j" / "r1"
    good = CheckpointCommit("j", "s", 20, str(run / "s" / "wb-x" / "20"), "sha256b:" + "1" * 64, ("p",))
    old = CheckpointCommit("j", "s", 10, str(run / "s" / "wb-x" / "10"), "sha256b:" + "0" * 64, ("p",))
    etcd_commit(wb, K, created_at(K.worker("wb"), inc_b))(old)
    etcd_commit(wb, K, created_at(K.worker("wb"), inc_b))(good)
    log, owner = Log(), places("wb", inc_b)
    kw: dict[str, Any] = dict(job="j", steps=100, places=owner, run_dir=run)
    assert promote(c0, K, c0.txn, log, worker="wb", slice_name="s", step=10, **kw) is not None
    assert promote(c0, K, c0.txn, log, worker="wb", slice_name="s", step=20, **kw) is not None
    # wa, which does not hold the slice, commits a later step naming the older directory and checksum.
    forged = CheckpointCommit("j", "s", 30, old.path, old.checksum, ("p",))
    etcd_commit(wa, K, created_at(K.worker("wa"), inc_a))(forged)
    assert promote(c0, K, c0.txn, log, worker="wa", slice_name="s", step=30, **kw) is None
    assert promote_pending(c0, K, c0.txn, log, **kw) == 0
    # The holder itself may not name a path outside the run's slice directory, a step past the job's, or an
    # unbound checksum.
    for bad in (CheckpointCommit("j", "s", 40, str(tmp_path / "elsewhere" / "40"), good.checksum),
                CheckpointCommit("j", "s", 50, str(run / "s" / ".." / ".." / "r0" / "s" / "50"), good.checksum),
                CheckpointCommit("j", "s", 500, str(run / "s" / "w" / "500"), good.checksum),
                CheckpointCommit("j", "s", 60, str(run / "s" / "w" / "60"), "sha256:" + "2" * 64)):
        etcd_commit(wb, K, created_at(K.worker("wb"), inc_b))(bad)
        assert promote(c0, K, c0.txn, log, worker="wb", slice_name="s", step=bad.step, **kw) is None
    assert sorted(c.step for c in read_commits(c0, K, "j")["s"]) == [10, 20]
    refusals = [kw["reason"] for what, kw in log.lines if what == "checkpoint.commit_refused"]
    assert any("does not hold slice" in r for r in refusals) and any("not in the slice's directory" in r
                                                                     for r in refusals)
    # A worker that forgets its commit (before retention deletes the checkpoint): it stops counting at once.
    etcd_commit(wb, K, created_at(K.worker("wb"), inc_b)).forget("j", "s", 10, old.path)
    assert [c.step for c in read_commits(c0, K, "j")["s"]] == [20]
    wa.revoke_lease(lease_a)
    wb.revoke_lease(lease_b)


def test_a_client_dialling_worker_b_refuses_worker_as_certificate(cluster: dict[str, Any]) -> None:
    import socket
    import threading
    from concurrent import futures

    import grpc

    from rallypoint.basics.tls import add_port, channel
    from rallypoint.workers.dataplane import DataPlaneClient

    certs = cluster["certs"]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = add_port(server, "127.0.0.1:0", certs["wa"])  # worker wa's certificate (or a thief of it) serves
    server.start()
    try:
        def call(worker: str) -> grpc.StatusCode:
            ch = channel(f"127.0.0.1:{port}", certs["c0"], worker=worker)
            try:
                ch.unary_unary("/rallypoint.v1.Worker/Ping")(b"", timeout=5)
            except grpc.RpcError as exc:
                return exc.code()
            finally:
                ch.close()
            return grpc.StatusCode.OK

        assert call("wa") == grpc.StatusCode.UNIMPLEMENTED  # reached: the certificate names wa
        assert call("wb") == grpc.StatusCode.UNAVAILABLE  # the handshake refused it: not wb
    finally:
        server.stop(None)
    # The data plane: a peer's certificate must name the worker the value is for.
    ctx = certs["wa"].server_context()
    lsock = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{lsock.getsockname()[1]}"

    def serve() -> None:
        for _ in range(2):
            conn, _ = lsock.accept()
            try:
                ctx.wrap_socket(conn, server_side=True).close()
            except OSError:
                conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    client = DataPlaneClient(timeout_s=5, tls=certs["wb"])
    client._connect(addr, "wa").close()  # noqa: SLF001 - the handshake and the check are what is tested
    with pytest.raises(OSError, match="is worker wa, not wb"):
        client._connect(addr, "wb")  # noqa: SLF001
    t.join(5)
    lsock.close()


def test_the_checksum_binds_job_run_slice_and_step(tmp_path: Path) -> None:
    import numpy as np

    from rallypoint.workers.checkpoints.checksums import binding, checksum_of, commit_binding, state_checksum

    states = {"p": [np.arange(6, dtype=np.float32).reshape(2, 3)]}
    mine = state_checksum(states, binding("j", "r1", "s", 10))
    assert mine.startswith("sha256b:")
    others = {state_checksum(states, binding(*b)) for b in
              (("k", "r1", "s", 10), ("j", "r2", "s", 10), ("j", "r1", "t", 10), ("j", "r1", "s", 20))}
    assert mine not in others and len(others) == 4
    # A commit of step 20 naming step 10's directory and checksum does not verify against the bytes it names.
    run = tmp_path / "j" / "r1"
    genuine = CheckpointCommit("j", "s", 10, str(run / "s" / "wx" / "10"), mine)
    forged = CheckpointCommit("j", "s", 20, genuine.path, mine)
    assert checksum_of(states, genuine.checksum, None, commit_binding(genuine)) == mine
    assert checksum_of(states, forged.checksum, None, commit_binding(forged)) != mine


def test_rallypoint_certs_adds_a_new_workers_own_etcd_user(cluster: dict[str, Any]) -> None:
    from click.testing import CliRunner

    from rallypoint.cli import main as cli

    d = cluster["dir"]
    r = CliRunner().invoke(cli, ["certs", "--out", str(d / "tls"), "--names", "wd:worker", "--cluster", "sec", "--etcd",
                                 cluster["etcd"].endpoints[0], "--root-password-file",
                                 str(d / "secrets" / ROOT_PASSWORD_FILE)])
    assert r.exit_code == 0, r.output
    assert "etcd user rallypoint-worker-wd" in r.output
    wd = EtcdStore(cluster["etcd"].endpoints, tls=TlsConfig.from_dir(d / "tls", "wd"), request_timeout_s=3)
    try:
        wd.put(K.worker("wd"), "{}")
        refused(lambda: wd.put(K.worker("wa"), "{}"))
        wd.delete(K.worker("wd"))
    finally:
        wd.close()


def test_a_worker_daemon_refuses_to_start_with_another_workers_certificate(tmp_path: Path) -> None:
    import shutil

    from rallypoint.basics.errors import ConfigError
    from rallypoint.cluster.daemons import tls_from_options

    issue(tmp_path, "wa", role=WORKER)
    assert tls_from_options(str(tmp_path), False, "wa", "worker") is not None
    for suffix in ("crt", "key"):  # wa's pair under wb's name: a daemon started as wb with a copy of wa's identity
        shutil.copy(tmp_path / f"wa.{suffix}", tmp_path / f"wb.{suffix}")
    with pytest.raises(ConfigError, match="names worker wa, not wb"):
        tls_from_options(str(tmp_path), False, "wb", "worker")


def test_servers_take_a_rotated_certificate_at_the_next_handshake_without_a_restart(tmp_path: Path) -> None:
    import socket
    import threading
    from concurrent import futures

    import grpc

    from rallypoint.basics.authz import worker_of_peercert
    from rallypoint.basics.tls import add_port, channel

    c0 = issue(tmp_path, "c0", role=COORDINATOR)
    served = issue(tmp_path, "rot", role=WORKER, worker="wa", days=1)  # about to end
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = add_port(server, "127.0.0.1:0", served)
    server.start()

    def reached(worker: str) -> bool:
        ch = channel(f"127.0.0.1:{port}", c0, worker=worker)  # a new channel: a new handshake
        try:
            ch.unary_unary("/rallypoint.v1.Worker/Ping")(b"", timeout=5)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            ch.close()
        return True

    ctx = served.reloading("server_context")
    lsock = socket.create_server(("127.0.0.1", 0))
    seen: list[str | None] = []

    def dial() -> None:
        conn, _ = lsock.accept()
        try:
            ctx.wrap_socket(conn, server_side=True).close()
        except OSError:
            conn.close()

    def peer() -> str | None:
        t = threading.Thread(target=dial, daemon=True)
        t.start()
        with socket.create_connection(lsock.getsockname(), timeout=5) as raw:
            with c0.client_context().wrap_socket(raw, server_hostname="127.0.0.1") as s:
                got = worker_of_peercert(s.getpeercert())
        t.join(5)
        return got

    try:
        assert reached("wa") and not reached("wz") and peer() == "wa"
        issue(tmp_path, "rot", role=WORKER, worker="wz")  # `rallypoint certs` again, same files (here another id)
        assert reached("wz") and not reached("wa")  # the gRPC server presents the new one
        seen.append(peer())
        assert seen == ["wz"]  # and so does the data plane's
    finally:
        server.stop(None)
        lsock.close()


def test_a_slices_earlier_writers_commits_past_retention_are_ended_by_the_leader(stores: dict[str, EtcdStore]) -> None:
    from rallypoint.orchestrator.job.promote import prune_others

    c0 = stores["c0"]

    def commit(worker: str, step: int) -> None:
        value = json.dumps({"job": "p", "slice": "s", "step": step, "path": f"/r/p/r1/s/{worker}/{step}",
                            "checksum": "sha256b:0", "worker": worker, "incarnation": 1})
        c0.put(K.worker_commit(worker, "p", "s", step), value)
        c0.put(K.checkpoint("p", "s", step), value)

    for step in (10, 20, 30):
        commit("wa", step)  # the slice's holder before a recovery
    for step in (40, 50):
        commit("wb", step)  # its holder now (keep 2)
    assert prune_others(c0, K, c0.txn, job="p", slice_name="s", worker="wb", keep=2, cut=20) == 2
    assert sorted(c.step for c in read_commits(c0, K, "p")["s"]) == [20, 40, 50]  # the cut's stays
    assert c0.get(K.worker_commit("wa", "p", "s", 10)) is None
