"""Restarting the processes of a local cluster that die (cluster/processes.py): backoff, the restart limit, roles.

Real processes (``sleep``) and real signals; the supervisor's passes are driven at chosen times.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from rallypoint.cluster.processes import ProcessRecord, RestartPolicy, Supervisor, is_running, stop_process

pytestmark = pytest.mark.processes  # starts `sleep` processes


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[Supervisor]:
    s = Supervisor([])
    try:
        yield s
    finally:
        for rec in s.records:
            stop_process(rec, grace_s=0.5)


def start(s: Supervisor, tmp_path: Path, role: str, name: str) -> ProcessRecord:
    return s.launch(role, name, ["sleep", "60"], tmp_path / f"{name}.log")


def kill(s: Supervisor, name: str) -> ProcessRecord:
    rec = s.find(name)
    s.signal(name, signal.SIGKILL)
    assert not is_running(rec)
    return rec


def test_a_dead_worker_is_restarted_after_its_backoff_which_doubles_up_to_the_limit(sup: Supervisor,
                                                                                   tmp_path: Path) -> None:
    start(sup, tmp_path, "worker", "w0")
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=3.0, limit=3, window_s=100.0)
    relaunch = lambda r: start(sup, tmp_path, r.role, r.name)  # noqa: E731
    t = 0.0
    delays = []
    for _ in range(3):
        dead = kill(sup, "w0")
        died = t
        assert sup.restart_exited(t, relaunch, policy) == []  # the backoff starts
        while not (out := sup.restart_exited(t, relaunch, policy)):
            t += 0.25
        assert [(d.pid, n.name) for d, n in out] == [(dead.pid, "w0")] and is_running(sup.find("w0"))
        assert sup.find("w0").pid != dead.pid
        delays.append(t - died)
        t += 10
    assert delays == [1.0, 2.0, 3.0]  # 1, 2, then 4 capped at 3
    kill(sup, "w0")
    for step in range(200):
        assert sup.restart_exited(t + step, relaunch, policy) == []
    assert "restart limit 3" in sup.given_up["w0"] and not is_running(sup.find("w0"))


def test_restarts_older_than_the_window_do_not_count(sup: Supervisor, tmp_path: Path) -> None:
    start(sup, tmp_path, "coordinator", "c0")
    policy = RestartPolicy(backoff_s=0.0, limit=1, window_s=10.0)
    relaunch = lambda r: start(sup, tmp_path, r.role, r.name)  # noqa: E731
    kill(sup, "c0")
    assert len(sup.restart_exited(0.0, relaunch, policy)) == 1
    kill(sup, "c0")
    assert len(sup.restart_exited(11.0, relaunch, policy)) == 1 and not sup.given_up
    kill(sup, "c0")
    assert sup.restart_exited(12.0, relaunch, policy) == [] and "c0" in sup.given_up


def test_a_process_that_ran_a_while_before_it_died_is_not_crash_looping_and_is_always_restarted(
        sup: Supervisor, tmp_path: Path) -> None:
    start(sup, tmp_path, "coordinator", "c0")
    policy = RestartPolicy(backoff_s=1.0, limit=2, window_s=1000.0, healthy_after_s=30.0)
    relaunch = lambda r: start(sup, tmp_path, r.role, r.name)  # noqa: E731
    t, delays = 0.0, []
    for _ in range(6):  # a storm kills the leader every 40 s: more deaths in the window than the limit
        kill(sup, "c0")
        died = t
        while not sup.restart_exited(t, relaunch, policy):
            t += 0.5
        delays.append(t - died)
        t += 40.0
    assert not sup.given_up and is_running(sup.find("c0"))
    assert delays[1:] == [1.0] * 5  # each death after 40 s of running: the backoff starts over
    kill(sup, "c0")  # then a crash loop: dying within seconds of each start
    for _ in range(40):
        sup.restart_exited(t, relaunch, policy)
        if is_running(sup.find("c0")):
            kill(sup, "c0")
        t += 0.5
    assert "restart limit 2" in sup.given_up["c0"]


def test_only_coordinators_and_workers_are_restarted(sup: Supervisor, tmp_path: Path) -> None:
    start(sup, tmp_path, "etcd", "etcd0")
    kill(sup, "etcd0")
    assert sup.restart_exited(100.0, lambda r: start(sup, tmp_path, r.role, r.name), RestartPolicy()) == []
    assert sup.restart_exited(200.0, lambda r: start(sup, tmp_path, r.role, r.name), RestartPolicy()) == []


def test_a_bad_restart_policy_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="backoff_s"):
        RestartPolicy(backoff_s=-1)
    with pytest.raises(ValueError, match="limit"):
        RestartPolicy(limit=-2)
