"""Pure tests of the placement policy orchestrator.devices.choose_devices and the snapshots."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.orchestrator.control.devices import choose_devices

from rallypoint.etcd.cluster_view import ClusterSnapshot, Holder, WorkerSnapshot
from rallypoint.etcd.cluster_view import WorkerInfo

_INCARNATIONS = iter(range(100, 10_000))


def _worker(name: str, devices: Iterable[int] = range(4), *, held: Iterable[int] = (),
            cordoned: bool = False, state: str = "serving") -> WorkerSnapshot:
    info = WorkerInfo(worker=name, incarnation=next(_INCARNATIONS), lease=0x10, address=f"{name}:1",
                      pid=1, devices=len(tuple(devices)), state=state, record={"state": state})
    holders = {d: Holder(job="job", slice=f"s{d}", nonce=f"n{d}") for d in held}
    return WorkerSnapshot(info=info, devices=tuple(sorted(devices)), holders=holders, cordoned=cordoned)


def _snapshot(*workers: WorkerSnapshot) -> ClusterSnapshot:
    return ClusterSnapshot(
        revision=7,
        workers={w.info.worker: w for w in workers},
        cordoned=frozenset(w.info.worker for w in workers if w.cordoned),
    )


# --- WorkerSnapshot / ClusterSnapshot -----------------------------------------------------------


def test_worker_state_values() -> None:
    assert _worker("a").state == "spare"
    assert _worker("a", held=[1]).state == "leased"
    assert _worker("a", cordoned=True).state == "cordoned"
    assert _worker("a", held=[1], cordoned=True).state == "cordoned"
    assert _worker("a", state="leaving").state == "leaving"
    assert _worker("a", held=[1], cordoned=True, state="leaving").state == "leaving"


def test_worker_free_devices() -> None:
    assert _worker("a", [0, 1, 2, 3], held=[1, 3]).free == [0, 2]
    assert _worker("a", [], held=[]).free == []


def test_cluster_spares_are_sorted_and_exclude_the_rest() -> None:
    snap = _snapshot(
        _worker("zeta"), _worker("alpha"), _worker("leased", held=[0]),
        _worker("cord", cordoned=True), _worker("bye", state="leaving"),
    )
    assert snap.spares == ["alpha", "zeta"]
    assert _snapshot().spares == []


# --- choose_devices -------------------------------------------------------------------------------


def test_never_picks_a_cordoned_or_leaving_worker() -> None:
    snap = _snapshot(_worker("c", range(8), cordoned=True), _worker("l", range(8), state="leaving"))
    assert choose_devices(snap, 1) is None
    assert choose_devices(_snapshot(*snap.workers.values(), _worker("ok", [5])), 1) == ("ok", [5])


def test_never_returns_a_held_device() -> None:
    snap = _snapshot(_worker("a", range(4), held=[0, 2]))
    assert choose_devices(snap, 2) == ("a", [1, 3])
    assert choose_devices(snap, 3) is None


def test_returns_exactly_count_devices_of_one_worker() -> None:
    snap = _snapshot(_worker("a", range(3)), _worker("b", range(3)))
    choice = choose_devices(snap, 2)
    assert choice == ("a", [0, 1])  # the name breaks the tie
    assert choose_devices(snap, 4) is None  # 6 free in all, but never across workers


def test_prefers_a_partly_leased_worker_to_keep_spares() -> None:
    snap = _snapshot(_worker("aaa-spare", range(2)), _worker("zzz-busy", range(8), held=[0, 1]))
    assert choose_devices(snap, 2) == ("zzz-busy", [2, 3])


def test_tightest_fit_among_equals() -> None:
    snap = _snapshot(_worker("big", range(8)), _worker("small", range(2)), _worker("mid", range(4)))
    assert choose_devices(snap, 2) == ("small", [0, 1])
    assert choose_devices(snap, 3) == ("mid", [0, 1, 2])
    leased = _snapshot(_worker("l8", range(8), held=[0]), _worker("l4", range(4), held=[0]))
    assert choose_devices(leased, 2) == ("l4", [1, 2])


def test_exclude_skips_workers() -> None:
    snap = _snapshot(_worker("a"), _worker("b"))
    assert choose_devices(snap, 1, exclude=frozenset({"a"})) == ("b", [0])
    assert choose_devices(snap, 1, exclude=frozenset({"a", "b"})) is None


def test_none_when_nothing_fits() -> None:
    assert choose_devices(_snapshot(), 1) is None
    assert choose_devices(_snapshot(_worker("a", range(4), held=range(4))), 1) is None
    assert choose_devices(_snapshot(_worker("a", range(2))), 3) is None


# --- property ----------------------------------------------------------------------------------------


@st.composite
def _snapshots(draw: st.DrawFn) -> ClusterSnapshot:
    names = draw(st.lists(st.sampled_from(["w0", "w1", "w2", "w3", "w4", "w5"]), unique=True, max_size=6))
    workers = []
    for name in names:
        devices = draw(st.lists(st.integers(0, 7), unique=True, max_size=8))
        held = draw(st.lists(st.sampled_from(devices), unique=True)) if devices else []
        workers.append(_worker(name, devices, held=held, cordoned=draw(st.booleans()),
                               state=draw(st.sampled_from(["serving", "serving", "leaving"]))))
    return _snapshot(*workers)


def _eligible(s: WorkerSnapshot, count: int, exclude: frozenset[str]) -> bool:
    return (s.info.worker not in exclude and not s.cordoned and s.info.state != "leaving"
            and len(s.free) >= count)


@settings(max_examples=300, deadline=None)
@given(snap=_snapshots(), count=st.integers(1, 8),
       exclude=st.frozensets(st.sampled_from(["w0", "w1", "w2", "w3", "w4", "w5"]), max_size=2))
def test_choice_invariants(snap: ClusterSnapshot, count: int, exclude: frozenset[str]) -> None:
    choice = choose_devices(snap, count, exclude=exclude)
    eligible = [s for s in snap.workers.values() if _eligible(s, count, exclude)]
    if choice is None:
        assert eligible == []
        return
    name, devices = choice
    chosen = snap.workers[name]
    assert chosen in eligible
    assert chosen.state in ("spare", "leased")
    assert name not in snap.cordoned
    assert len(devices) == count and len(set(devices)) == count
    assert set(devices) <= set(chosen.devices)
    assert not set(devices) & set(chosen.holders)
    if any(s.holders for s in eligible):
        assert chosen.holders, "took a whole spare while a partly leased worker fit"
        assert all(len(chosen.free) <= len(s.free) for s in eligible if s.holders)
    else:
        assert all(len(chosen.free) <= len(s.free) for s in eligible)
    assert devices == chosen.free[:count]  # the lowest free indices


@pytest.mark.parametrize("count", [1, 2, 4])
def test_choice_is_deterministic(count: int) -> None:
    workers = [_worker(f"w{i}", range(4), held=[0] if i % 2 else []) for i in range(6)]
    forward, backward = _snapshot(*workers), _snapshot(*reversed(workers))
    assert choose_devices(forward, count) == choose_devices(backward, count)
