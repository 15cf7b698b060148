"""A certificate authority and per-process certificates for a cluster (``rallypoint certs``).

EC P-256 keys (a certificate takes a few milliseconds), SHA-256 signatures. Each process
certificate is good for both ends of a connection (server and client auth), names the
process and the addresses it is reached at as subject-alternative names (so clients check
the name they dialled), carries its role as the URI SAN ``rallypoint://role/ROLE``
(:mod:`rallypoint.basics.authz`: what each server lets it call) and the role's etcd user
``BASE-ROLE`` as its common name (see :mod:`rallypoint.basics.tls`). A worker's certificate also
names the worker's id: the URI SAN ``rallypoint://worker/ID``, the DNS name
``ID.worker.rallypoint`` that a client dialling that worker checks, and its own etcd user
``BASE-worker-ID`` (:mod:`rallypoint.etcd.auth`), so one worker's key cannot pass as another
worker. Certificates last :data:`CERT_DAYS` (90) days unless told otherwise: there is no
revocation list, so a stolen key stops working when its certificate ends; make them again
before (``rallypoint certs`` again, then restart each process, or let it reload them).
Keys are written mode 0600. An existing CA in the directory is kept and signs the new certificates; an existing
certificate is replaced.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rallypoint.basics.authz import COORDINATOR, ROLES, WORKER, etcd_user, role_uri, worker_server_name, worker_uri
from rallypoint.basics.errors import ConfigError
from rallypoint.etcd.keys import check_name
from rallypoint.basics.tls import CA_FILE, CA_KEY_FILE, ETCD_USER, TlsConfig

DEFAULT_HOSTS = ("127.0.0.1", "localhost")
CA_DAYS = 3650
CERT_DAYS = 90  # short: nothing revokes a certificate; `rallypoint certs --days N` sets another


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    tmp.replace(path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)  # allow clock skew


def _load_ca(out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    crt, key = out / CA_FILE, out / CA_KEY_FILE
    try:
        cert = x509.load_pem_x509_certificate(crt.read_bytes())
        pkey = serialization.load_pem_private_key(key.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"the CA in {out} ({crt}, {key}) cannot be loaded ({exc}); remove both to make a new "
                          "CA (every certificate it signed must then be made again)") from None
    if not isinstance(pkey, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{key} is not an EC key; remove {crt} and {key} to make a new CA")
    return cert, pkey


def ensure_ca(out: Path, *, cluster: str = "local") -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA of ``out`` (made when ``ca.crt`` is missing)."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / CA_FILE).exists():
        return _load_ca(out)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Rallypoint"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"Rallypoint CA {cluster}")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(_now())
            .not_valid_after(_now() + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write(out / CA_KEY_FILE, _key_pem(key), secret=True)
    _write(out / CA_FILE, cert.public_bytes(serialization.Encoding.PEM), secret=False)
    return cert, key


def role_for(name: str) -> str:
    """The role a certificate named ``name`` gets when none is given: ``NAME`` for a role's own
    name (``client``, ``operator``, ``etcd``, ...), coordinator for ``cN``, worker for ``wN``.

    Raises ConfigError for any other name: give it with its role, ``NAME:ROLE``.
    """
    if name in ROLES:
        return name
    if re.fullmatch(r"c\d+", name):
        return COORDINATOR
    if re.fullmatch(r"w\d+", name):
        return WORKER
    raise ConfigError(f"no role for certificate {name!r}: name it NAME:ROLE (one of {', '.join(ROLES)}), e.g. "
                      f"{name}:worker; only cN, wN and the roles' own names get one by themselves")


def parse_names(names: Sequence[str]) -> dict[str, str]:
    """``NAME[:ROLE]`` entries to ``{name: role}``; ConfigError naming a bad role or a missing one."""
    out: dict[str, str] = {}
    for entry in names:
        name, sep, role = entry.partition(":")
        check_name("certificate", name)
        if not sep:
            role = role_for(name)
        elif role not in ROLES:
            raise ConfigError(f"certificate {entry!r}: unknown role {role!r}; one of {', '.join(ROLES)}")
        out[name] = role
    return out


def _san(name: str, hosts: Iterable[str], role: str, worker: str | None) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = [x509.UniformResourceIdentifier(role_uri(role))]
    if worker is not None:
        entries += [x509.UniformResourceIdentifier(worker_uri(worker)), x509.DNSName(worker_server_name(worker))]
    for h in dict.fromkeys([name, *hosts]):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            entries.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(entries)


def issue(out: Path, name: str, *, role: str | None = None, hosts: Sequence[str] = DEFAULT_HOSTS,
          user: str = ETCD_USER, cluster: str = "local", worker: str | None = None,
          days: int = CERT_DAYS) -> TlsConfig:
    """Make ``out/NAME.crt`` and ``out/NAME.key`` signed by the CA of ``out``; return their TlsConfig.

    ``role``: what the certificate may do (default :func:`role_for` ``name``); ``hosts``: the
    IPs and DNS names the process is reached at (subject-alternative names, beside ``name``
    itself); ``user``: the base of the etcd user the process acts as, the common name
    ``USER-ROLE`` (``USER-worker-ID`` for a worker); ``worker``: a worker certificate's worker id
    (default ``name``: the daemon's ``--worker-id`` must be it); ``days``: how long it is good for.
    """
    check_name("certificate", name)
    role = role_for(name) if role is None else role
    if role not in ROLES:
        raise ConfigError(f"certificate {name!r}: unknown role {role!r}; one of {', '.join(ROLES)}")
    if days < 1:
        raise ConfigError(f"certificate {name!r}: --days must be at least 1, got {days}")
    wid = check_name("worker", worker or name) if role == WORKER else None
    ca_cert, ca_key = ensure_ca(out, cluster=cluster)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Rallypoint"),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, name),
                         x509.NameAttribute(NameOID.COMMON_NAME, etcd_user(user, role, wid))])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(_now()).not_valid_after(_now() + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(name, hosts, role, wid), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(out / f"{name}.key", _key_pem(key), secret=True)
    _write(out / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM), secret=False)
    return TlsConfig(out / CA_FILE, out / f"{name}.crt", out / f"{name}.key")


def make_certs(out: Path, names: Sequence[str], *, hosts: Sequence[str] = DEFAULT_HOSTS, user: str = ETCD_USER,
               cluster: str = "local", days: int = CERT_DAYS) -> dict[str, TlsConfig]:
    """A CA (kept if present) and one certificate per ``NAME[:ROLE]`` in ``out`` (:func:`parse_names`); a worker's
    names its id ``NAME``."""
    roles = parse_names(names)  # every name checked before anything is written
    return {n: issue(out, n, role=r, hosts=hosts, user=user, cluster=cluster, days=days) for n, r in roles.items()}
