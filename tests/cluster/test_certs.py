"""`rallypoint certs` and TLS identities: what is made, and clear errors for missing or bad files."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.x509.oid import NameOID

from rallypoint.cli import main as cli
from rallypoint.cluster import daemons
from rallypoint.basics.authz import role_of_pem
from rallypoint.cluster.certs import make_certs
from rallypoint.basics.errors import ConfigError
from rallypoint.basics.tls import TlsConfig


def test_certs_command_makes_a_ca_and_per_process_certificates(tmp_path: Path) -> None:
    out = tmp_path / "tls"
    r = CliRunner().invoke(cli, ["certs", "--out", str(out), "--names", "c0,w0,client,gpu7:worker,admin:operator",
                                 "--hosts", "10.1.2.3,db.lan", "--days", "30"])
    assert r.exit_code == 0, r.output
    assert "gpu7 (role worker, 30 days)" in r.output and "admin (role operator, 30 days)" in r.output
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    roles = {"c0": "coordinator", "w0": "worker", "client": "client", "gpu7": "worker", "admin": "operator"}
    for name, role in roles.items():
        cert = x509.load_pem_x509_certificate((out / f"{name}.crt").read_bytes())
        assert cert.issuer == ca.subject
        cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        worker = role == "worker"  # a worker's certificate names its id: its own etcd user, URI and DNS name
        assert cn == (f"rallypoint-worker-{name}" if worker else f"rallypoint-{role}")  # the etcd user
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(san.get_values_for_type(x509.DNSName)) == {name, "db.lan"} | ({f"{name}.worker.rallypoint"}
                                                                               if worker else set())
        assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.1.2.3"]
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [f"rallypoint://role/{role}"] + (
            [f"rallypoint://worker/{name}"] if worker else [])
        assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == 30  # --days
        assert role_of_pem((out / f"{name}.crt").read_bytes()) == role
        assert (out / f"{name}.key").stat().st_mode & 0o077 == 0
        TlsConfig.from_dir(out, name)  # loads and the pair matches
    assert (out / "ca.key").stat().st_mode & 0o077 == 0
    before = (out / "ca.crt").read_bytes()
    make_certs(out, ["w1"])  # the CA is kept and signs the new one
    assert (out / "ca.crt").read_bytes() == before
    assert x509.load_pem_x509_certificate((out / "w1.crt").read_bytes()).issuer == ca.subject


def test_a_name_without_a_role_or_an_unknown_role_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    for names, why in (("w0,trainer", "no role for certificate 'trainer': name it NAME:ROLE"),
                       ("w0,w1:boss", "unknown role 'boss'")):
        r = CliRunner().invoke(cli, ["certs", "--out", str(tmp_path / "tls"), "--names", names])
        assert r.exit_code == 1 and why in r.output, r.output
        assert not (tmp_path / "tls").exists()  # every name is checked before anything is made


def test_missing_or_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist.*rallypoint certs"):
        TlsConfig.from_dir(tmp_path / "nope", "w0")
    make_certs(tmp_path, ["w0", "w1"])
    (tmp_path / "w1.key").unlink()
    with pytest.raises(ConfigError, match=r"w1\.key does not exist"):
        TlsConfig.from_dir(tmp_path, "w1")
    (tmp_path / "w0.crt").write_text("garbage")
    with pytest.raises(ConfigError, match=r"w0\.crt is not a PEM file"):
        TlsConfig.from_dir(tmp_path, "w0")
    make_certs(tmp_path, ["w0", "w2"])
    (tmp_path / "w0.key").write_bytes((tmp_path / "w2.key").read_bytes())
    with pytest.raises(ConfigError, match=r"w0\.key does not match certificate .*w0\.crt"):
        TlsConfig.from_dir(tmp_path, "w0")


def test_a_daemon_needs_a_tls_dir_or_an_explicit_insecure(tmp_path: Path) -> None:
    base = ["worker", "--cluster", "t@127.0.0.1:1", "--id", "w0"]
    r = CliRunner().invoke(daemons.main, base)
    assert r.exit_code == 1 and "--tls-dir" in r.output and "--insecure" in r.output
    r = CliRunner().invoke(daemons.main, [*base, "--tls-dir", str(tmp_path)])
    assert r.exit_code == 1 and "w0.crt" not in r.output and "ca.crt does not exist" in r.output
    r = CliRunner().invoke(daemons.main, [*base, "--tls-dir", str(tmp_path), "--insecure"])
    assert r.exit_code == 1 and "exclude each other" in r.output
    r = CliRunner().invoke(daemons.main, ["coordinator", "--cluster", "t@127.0.0.1:1", "--id", "c0"])
    assert r.exit_code == 1 and "--insecure" in r.output


def test_a_daemon_refuses_a_certificate_of_another_role(tmp_path: Path) -> None:
    make_certs(tmp_path, ["w0:client", "c0:worker"])  # e.g. a client's certificate copied to a worker host
    r = CliRunner().invoke(daemons.main, ["worker", "--cluster", "t@127.0.0.1:1", "--id", "w0", "--tls-dir",
                                          str(tmp_path)])
    assert r.exit_code == 1 and "w0.crt has role client, not worker" in r.output, r.output
    assert "rallypoint certs --names w0:worker" in r.output
    r = CliRunner().invoke(daemons.main, ["coordinator", "--cluster", "t@127.0.0.1:1", "--id", "c0", "--tls-dir",
                                          str(tmp_path)])
    assert r.exit_code == 1 and "c0.crt has role worker, not coordinator" in r.output, r.output
