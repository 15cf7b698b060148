"""Tests for the etcd key schema etcd.keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rallypoint.basics.errors import ConfigError
from rallypoint.etcd.keys import ROOT, Keys, check_name

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("etcd", "orchestrator", "workers", "client", "cluster", "recovery", "chaos")
KEYS_MODULE = REPO / "etcd" / "keys.py"

_names = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")


def _all_keys(k: Keys) -> list[str]:
    return [
        k.workers, k.worker("w1"), k.devices, k.worker_devices("w1"), k.device("w1", 3),
        k.leases, k.worker_leases("w1"), k.lease("w1", 3), k.cordons, k.cordon("w1"),
        k.lost_workers, k.lost("w1"), k.coordinators, k.coordinator("c1"), k.leader,
        k.jobs, k.job("j1"),
    ]


def test_prefix_is_under_the_root() -> None:
    assert ROOT == "/rallypoint"
    assert Keys("prod").prefix == "/rallypoint/prod/"


def test_every_builder_is_under_the_cluster_prefix() -> None:
    k = Keys("c1")
    keys = _all_keys(k)
    assert all(key.startswith(k.prefix) and key != k.prefix for key in keys)
    assert len(set(keys)) == len(keys)
    assert not any(key.startswith(Keys("c").prefix) for key in keys)  # "c" is not a prefix of "c1"


def test_concrete_layout() -> None:
    k = Keys("t")
    assert k.worker("w1") == "/rallypoint/t/workers/w1"
    assert k.device("w1", 0) == "/rallypoint/t/devices/w1/0"
    assert k.lease("w1", 2) == "/rallypoint/t/leases/w1/2"
    assert k.cordon("w1") == "/rallypoint/t/cordon/w1"
    assert k.lost("w1") == "/rallypoint/t/lost/w1"
    assert k.coordinator("c") == "/rallypoint/t/coordinators/c"
    assert k.leader == "/rallypoint/t/leader"
    assert k.job("j") == "/rallypoint/t/jobs/j"


def test_item_keys_sit_under_their_collection() -> None:
    k = Keys("t")
    pairs = [
        (k.worker("w"), k.workers), (k.device("w", 1), k.worker_devices("w")),
        (k.worker_devices("w"), k.devices), (k.lease("w", 1), k.worker_leases("w")),
        (k.worker_leases("w"), k.leases), (k.cordon("w"), k.cordons), (k.lost("w"), k.lost_workers),
        (k.coordinator("c"), k.coordinators), (k.job("j"), k.jobs),
    ]
    for key, collection in pairs:
        assert collection.endswith("/") and key.startswith(collection)
    # A worker's collections do not contain another worker whose name extends it.
    assert not k.device("w10", 0).startswith(k.worker_devices("w1"))
    assert not k.lease("w10", 0).startswith(k.worker_leases("w1"))


@given(cluster=_names, worker=_names, index=st.integers(0, 4096))
def test_tail_inverts_device_and_lease(cluster: str, worker: str, index: int) -> None:
    k = Keys(cluster)
    assert k.tail(k.device(worker, index), k.devices) == [worker, str(index)]
    assert k.tail(k.lease(worker, index), k.leases) == [worker, str(index)]
    assert k.tail(k.worker(worker), k.workers) == [worker]
    assert k.tail(k.device(worker, index), k.worker_devices(worker)) == [str(index)]


def test_tail_rejects_a_key_outside_the_prefix() -> None:
    k = Keys("t")
    with pytest.raises(ValueError, match="is not under"):
        k.tail(k.worker("w1"), k.devices)


@pytest.mark.parametrize("name", ["a", "A-1_b.c", "0", "x" * 63])
def test_valid_names(name: str) -> None:
    assert check_name("worker", name) == name
    assert Keys(name).cluster == name


@pytest.mark.parametrize("name", ["", "-a", ".a", "_a", "a b", "a/b", "x" * 64, "é", "a\n", "w:1"])
@pytest.mark.parametrize("kind", ["worker", "job", "slice", "coordinator"])
def test_invalid_names_raise_config_error_naming_the_kind(kind: str, name: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_name(kind, name)
    message = str(info.value)
    assert message.startswith(f"invalid {kind} name {name!r}")
    assert "1-63 letters" in message


@pytest.mark.parametrize("name", ["", "a/b", "../x", "x" * 64])
def test_invalid_cluster_name(name: str) -> None:
    with pytest.raises(ConfigError, match=r"^invalid cluster name"):
        Keys(name)


def _scanned_files() -> list[Path]:
    files = [p for d in SCANNED if (REPO / d).is_dir() for p in sorted((REPO / d).rglob("*.py"))]
    return [p for p in files if p.resolve() != KEYS_MODULE and ".venv" not in p.parts]


def test_scan_covers_the_code() -> None:
    names = {p.relative_to(REPO).as_posix() for p in _scanned_files()}
    assert {"etcd/store.py", "orchestrator/control/membership.py", "orchestrator/control/devices.py"} <= names
    assert "etcd/keys.py" not in names
    assert not any(n.startswith("tests/") for n in names)


def test_no_module_builds_keys_by_hand() -> None:
    offenders = [
        f"{p.relative_to(REPO)}:{n}"
        for p in _scanned_files()
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1)
        if "/rallypoint/" in line
    ]
    assert offenders == [], f"build keys with etcd.keys.Keys, not by hand: {offenders}"
