"""Roles: who may call what. The one table of gRPC methods (and the data plane) to the roles allowed.

Every certificate of a cluster carries one role as a URI subject-alternative name,
``rallypoint://role/<role>`` (:mod:`rallypoint.cluster.certs` writes it). Each server with TLS
reads the role of the peer's certificate and refuses a call whose method does not list it:
gRPC with ``PERMISSION_DENIED`` naming the method and the role (:func:`interceptors`), the
data plane with ``REFUSED`` before it reads a frame (:func:`refusal` on :data:`DATA_PLANE`).
A method missing from :data:`ALLOWED` is refused to every role, so a new method is closed
until it is added here. With plain TCP (``--insecure``) there is no certificate and no check.

etcd is checked by etcd itself: each role is its own etcd user (the certificate's common
name, :func:`etcd_user`) with the key ranges of :mod:`rallypoint.etcd.auth`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc

CLIENT = "client"  # submits, resumes and watches jobs; reads the cluster's state
OPERATOR = "operator"  # a client that also administers: cordon, drain, health pings, key repairs
COORDINATOR = "coordinator"  # leads: drives the workers, writes every key of the cluster
WORKER = "worker"  # runs slices: registers itself, pushes values to peers, commits checkpoints
ETCD = "etcd"  # an etcd member (server and peer certificate; calls no Rallypoint method)
ROLES = (CLIENT, OPERATOR, COORDINATOR, WORKER, ETCD)
ROLE_URI_PREFIX = "rallypoint://role/"
WORKER_URI_PREFIX = "rallypoint://worker/"  # a worker certificate's id: rallypoint://worker/<id>
WORKER_NAME_SUFFIX = ".worker.rallypoint"  # a worker certificate's DNS name <id>.worker.rallypoint, what clients check

DATA_PLANE = "dataplane"  # the worker's tensor socket (workers/dataplane.py), checked like a method

_COORDINATOR = "/rallypoint.v1.Coordinator/"
_WORKER = "/rallypoint.v1.Worker/"
_RUNTIME = "/rallypoint.v1.WorkerRuntime/"

_LEADER_ONLY = frozenset({COORDINATOR})
_PEERS = frozenset({WORKER})
_CALLERS = frozenset({CLIENT, OPERATOR})

ALLOWED: Mapping[str, frozenset[str]] = {
    # The job service: what a user does. A worker or a coordinator never submits.
    _COORDINATOR + "SubmitJob": _CALLERS,
    _COORDINATOR + "ResumeJob": _CALLERS,
    _COORDINATOR + "WatchJob": _CALLERS,
    _COORDINATOR + "CancelJob": _CALLERS,  # a user stops their own job
    _COORDINATOR + "SuspendJob": frozenset({OPERATOR}),  # setting a job aside is the operator's call
    # A worker's control service: the leader's (a Ping carries a term, a fencing token, so
    # only the leader and an operator's health check may send one).
    _WORKER + "Ping": frozenset({COORDINATOR, OPERATOR}),
    _WORKER + "Attach": _LEADER_ONLY,
    _RUNTIME + "LoadJob": _LEADER_ONLY,
    _RUNTIME + "RunSteps": _LEADER_ONLY,
    _RUNTIME + "JobEvents": _LEADER_ONLY,
    _RUNTIME + "FetchState": _LEADER_ONLY,
    _RUNTIME + "UnloadJob": _LEADER_ONLY,
    _RUNTIME + "Rewire": _LEADER_ONLY,
    _RUNTIME + "WarmJob": _LEADER_ONLY,
    # Worker to worker: values a slice sends its consumers, and copies of commits.
    _RUNTIME + "Push": _PEERS,
    _RUNTIME + "PushReplica": _PEERS,
    _RUNTIME + "FetchReplica": _PEERS,
    _RUNTIME + "Member": _PEERS,  # a multi-host slice's driver, a worker, starts its members on the others
    DATA_PLANE: _PEERS,
}


def role_uri(role: str) -> str:
    """The URI SAN naming ``role`` in a certificate."""
    check_role(role)
    return ROLE_URI_PREFIX + role


def check_role(role: str) -> str:
    """``role`` itself; ValueError naming the known roles when it is not one."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    return role


def etcd_user(base: str, role: str, worker: str | None = None) -> str:
    """The etcd user a certificate of ``role`` acts as (its common name): ``BASE-ROLE``, and for a worker
    ``BASE-worker-ID`` (each worker its own user, confined to its own keys: :mod:`rallypoint.etcd.auth`)."""
    check_role(role)
    if role == WORKER and worker:
        return f"{base}-{role}-{worker}"
    return f"{base}-{role}"


def worker_uri(worker: str) -> str:
    """The URI SAN naming a worker certificate's id."""
    return WORKER_URI_PREFIX + worker


def worker_server_name(worker: str) -> str:
    """The DNS name a worker certificate carries for its id, which a client dialling that worker checks
    (gRPC's target name, the data plane's ``server_hostname``): ``<id>.worker.rallypoint``."""
    return worker.lower() + WORKER_NAME_SUFFIX


def worker_of_uris(uris: Iterable[str]) -> str | None:
    """The one worker id the URI SANs name (None: none, or more than one)."""
    ids = {u[len(WORKER_URI_PREFIX):] for u in uris if u.startswith(WORKER_URI_PREFIX)}
    return next(iter(ids)) if len(ids) == 1 else None


def worker_of_peercert(peercert: Mapping[str, Any] | None) -> str | None:
    """The worker id of a verified peer certificate as :meth:`ssl.SSLSocket.getpeercert` gives it."""
    if not peercert:
        return None
    return worker_of_uris(v for k, v in peercert.get("subjectAltName", ()) if k == "URI")


def role_of_uris(uris: Iterable[str]) -> str | None:
    """The one role the URI SANs name; None when none or more than one does (such a peer has no role)."""
    roles = {u[len(ROLE_URI_PREFIX):] for u in uris if u.startswith(ROLE_URI_PREFIX)}
    if len(roles) != 1:
        return None
    (role,) = roles
    return role if role in ROLES else None


@functools.lru_cache(maxsize=256)
def role_of_pem(pem: bytes) -> str | None:
    """The role of a PEM certificate (None: it names none); cached, a peer's certificate repeats."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    return role_of_uris(san.get_values_for_type(x509.UniformResourceIdentifier))


def role_of_peercert(peercert: Mapping[str, Any] | None) -> str | None:
    """The role of a verified peer certificate as :meth:`ssl.SSLSocket.getpeercert` gives it."""
    if not peercert:
        return None
    return role_of_uris(v for k, v in peercert.get("subjectAltName", ()) if k == "URI")


def refusal(method: str, role: str | None) -> str | None:
    """Why ``role`` may not call ``method`` (None: it may)."""
    allowed = ALLOWED.get(method)
    if allowed is None:
        return f"{method} is not a method any role may call"
    if role in allowed:
        return None
    who = f"role {role!r}" if role else "a certificate without a role (no rallypoint://role/ SAN)"
    return f"{method} is refused to {who}: it is allowed to {', '.join(sorted(allowed))} only (docs/security.md)"


@functools.lru_cache(maxsize=256)
def identity_of_pem(pem: bytes) -> str | None:
    """``ROLE:NAME`` of a PEM certificate: its role and the name it was issued under (the organizational
    unit :mod:`rallypoint.cluster.certs` writes; else the common name). None: it names no role."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    role = role_of_pem(pem)
    if role is None:
        return None
    cert = x509.load_pem_x509_certificate(pem)
    for oid in (NameOID.ORGANIZATIONAL_UNIT_NAME, NameOID.COMMON_NAME):
        names = cert.subject.get_attributes_for_oid(oid)
        if names:
            return f"{role}:{names[0].value}"
    return f"{role}:"


def peer_identity(context: grpc.ServicerContext) -> str | None:
    """Who the gRPC peer is by its certificate, ``ROLE:NAME`` (None: no certificate, ``--insecure``, or no role):
    what the leader records as a job's owner and as who stopped it, never the caller's own word."""
    pems = context.auth_context().get("x509_pem_cert") or []
    return identity_of_pem(bytes(pems[0])) if pems else None


def peer_role(context: grpc.ServicerContext) -> str | None:
    """The role of the gRPC peer's certificate (None: no certificate or no role)."""
    pems = context.auth_context().get("x509_pem_cert") or []
    return role_of_pem(bytes(pems[0])) if pems else None


def moves_term(context: grpc.ServicerContext, tls: object | None) -> bool:
    """Whether a call's coordinator term may raise a worker's newest term (its fencing token).

    With TLS only a coordinator-role caller's may: a worker's, an operator's or a client's term is
    checked against the newest one (a stale one is refused) and never adopted, so no stolen
    worker certificate can fence the real leader out. With plain TCP (``--insecure``) there are
    no roles: the leader's methods (each caller of the worker's service decides to pass ``True``
    only for those) move it, a peer's (``Push``, ``Member``, the data plane) never do.
    """
    return tls is None or peer_role(context) == COORDINATOR


def _guard(method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(request: Any, context: grpc.ServicerContext) -> Any:
        why = refusal(method, peer_role(context))
        if why is not None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        return behavior(request, context)

    return guarded


class RoleInterceptor(grpc.ServerInterceptor):
    """Refuses (``PERMISSION_DENIED``) every call whose method :data:`ALLOWED` does not grant the peer's role."""

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_guard(method, handler.unary_unary),
                                                       handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_guard(method, handler.unary_stream),
                                                        handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_guard(method, handler.stream_unary),
                                                        handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(_guard(method, handler.stream_stream),
                                                     handler.request_deserializer, handler.response_serializer)


def interceptors(tls: object | None) -> list[grpc.ServerInterceptor]:
    """The interceptors of a gRPC server: the role check with TLS, none with plain TCP (no certificates)."""
    return [] if tls is None else [RoleInterceptor()]
