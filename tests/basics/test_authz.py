"""The role table and role extraction (pure: certificates made in a tmp dir, no process, no socket)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint.basics import authz
from rallypoint.cluster.certs import make_certs
from rallypoint.proto import rallypoint_pb2

SERVICES = ("Coordinator", "Worker", "WorkerRuntime")


def _methods() -> list[str]:
    pkg = rallypoint_pb2.DESCRIPTOR.package
    return [f"/{pkg}.{s}/{m.name}" for s in SERVICES
            for m in rallypoint_pb2.DESCRIPTOR.services_by_name[s].methods]


def test_every_grpc_method_has_an_entry_and_nothing_else_does() -> None:
    methods = _methods()
    assert set(authz.ALLOWED) == {*methods, authz.DATA_PLANE}  # a new method is refused until it is listed
    for method, roles in authz.ALLOWED.items():
        assert roles and roles <= set(authz.ROLES) - {authz.ETCD}, method


@pytest.mark.parametrize("method", ["SubmitJob", "ResumeJob", "WatchJob", "CancelJob"])
def test_only_clients_and_operators_use_the_job_service(method: str) -> None:
    m = f"/rallypoint.v1.Coordinator/{method}"
    assert authz.refusal(m, "client") is None and authz.refusal(m, "operator") is None
    for role in ("worker", "coordinator", "etcd", None):
        why = authz.refusal(m, role)
        assert why is not None and m in why


def test_only_an_operator_sets_a_job_aside() -> None:
    m = "/rallypoint.v1.Coordinator/SuspendJob"
    assert authz.refusal(m, "operator") is None
    for role in ("client", "worker", "coordinator", "etcd", None):
        why = authz.refusal(m, role)
        assert why is not None and m in why


def test_a_worker_certificate_cannot_drive_another_worker_but_may_push_to_it() -> None:
    for method in ("LoadJob", "RunSteps", "UnloadJob", "Rewire", "FetchState", "JobEvents", "WarmJob"):
        m = f"/rallypoint.v1.WorkerRuntime/{method}"
        assert authz.refusal(m, "coordinator") is None
        for role in ("worker", "client", "operator"):
            why = authz.refusal(m, role)
            assert why == f"{m} is refused to role {role!r}: it is allowed to coordinator only (docs/security.md)"
    for method in ("Push", "PushReplica", "FetchReplica"):
        m = f"/rallypoint.v1.WorkerRuntime/{method}"
        assert authz.refusal(m, "worker") is None
        assert authz.refusal(m, "client") is not None and authz.refusal(m, "coordinator") is not None
    assert authz.refusal(authz.DATA_PLANE, "worker") is None
    assert authz.refusal(authz.DATA_PLANE, "client") is not None
    # A Ping carries a coordinator term (a fencing token): no client or worker may send one.
    assert authz.refusal("/rallypoint.v1.Worker/Ping", "client") is not None
    assert authz.refusal("/rallypoint.v1.Worker/Ping", "worker") is not None
    assert authz.refusal("/rallypoint.v1.Worker/Ping", "operator") is None


def test_unknown_methods_and_roleless_peers_are_refused() -> None:
    assert authz.refusal("/rallypoint.v1.Worker/Shutdown", "coordinator") == (
        "/rallypoint.v1.Worker/Shutdown is not a method any role may call")
    why = authz.refusal("/rallypoint.v1.Coordinator/SubmitJob", None)
    assert why is not None and "without a role" in why


def test_role_extraction_from_uri_sans_pem_and_peercert(tmp_path: Path) -> None:
    assert authz.role_of_uris(["rallypoint://role/worker", "spiffe://x"]) == "worker"
    assert authz.role_of_uris([]) is None
    assert authz.role_of_uris(["rallypoint://role/worker", "rallypoint://role/client"]) is None  # ambiguous: none
    assert authz.role_of_uris(["rallypoint://role/root"]) is None  # not a role
    made = make_certs(tmp_path, ["w3", "client", "c1", "x:operator"])
    for name, role in (("w3", "worker"), ("client", "client"), ("c1", "coordinator"), ("x", "operator")):
        assert authz.role_of_pem(made[name].cert.read_bytes()) == role
    assert authz.role_of_pem(b"-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n") is None
    peercert = {"subject": ((("commonName", "rallypoint-worker"),),),
                "subjectAltName": (("DNS", "w3"), ("URI", "rallypoint://role/worker"), ("IP Address", "127.0.0.1"))}
    assert authz.role_of_peercert(peercert) == "worker"
    assert authz.role_of_peercert({"subjectAltName": (("DNS", "w3"),)}) is None
    assert authz.role_of_peercert(None) is None


def test_roles_name_their_etcd_users_and_unknown_roles_are_errors() -> None:
    assert authz.etcd_user("rallypoint", "worker") == "rallypoint-worker"
    assert authz.role_uri("client") == "rallypoint://role/client"
    with pytest.raises(ValueError, match="unknown role 'boss'"):
        authz.role_uri("boss")
    assert authz.interceptors(None) == []
