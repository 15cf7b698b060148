"""Shared fixtures: real etcd and real local clusters on free loopback ports, in tmp dirs."""

from __future__ import annotations

import _posixsubprocess
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import pytest

from rallypoint.etcd.server import EtcdCluster
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig, is_running
from rallypoint.etcd.etcd_store import EtcdStore
from rallypoint.workers.programs import configure_compile_cache

# The client-side tests compile programs for slices of up to 4 devices and run the
# reference on several device sets: give this process 8 CPU devices before any JAX
# operation runs. (A config, not XLA_FLAGS, so worker processes do not inherit it.)
jax.config.update("jax_num_cpu_devices", 8)

# A persistent compilation cache for this process, for the session: the same programs (the examples, their
# references, in-process workers) are compiled by many tests, and from the second time on they are loaded.
# Set before anything compiles (JAX decides once per process); removed when the session ends.
# Under pytest-xdist (`make test TEST_PROCS=2`: two processes) the processes of one session share it: the
# first (the controller) makes it and names it in RALLYPOINT_TESTS_JAX_CACHE, which the others inherit.
def _session_dir(variable: str, prefix: str) -> tuple[Path, bool]:
    """The session's directory named by ``variable`` (made, and named there, if none is): (path, made here)."""
    named = os.environ.get(variable)
    if named:
        return Path(named), False
    made = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ[variable] = str(made)
    return made, True


JAX_CACHE, _OWN_JAX_CACHE = _session_dir("RALLYPOINT_TESTS_JAX_CACHE", "rallypoint-tests-jax-cache-")
configure_compile_cache(JAX_CACHE)


# Matplotlib's config and font cache for the session, in a temporary directory of its own (inherited by every
# process the tests start): a home that never ran matplotlib makes its first import run `fc-list` in a
# subprocess, which the fast tier's process guard below refuses, so a suite that passed on a warm home failed on
# a fresh one. The font cache is built here, once, before any guard is in place; no cache outside the checkout
# is read or written.
MPL_CONFIG = Path(tempfile.mkdtemp(prefix="rallypoint-tests-mpl-"))
os.environ["MPLCONFIGDIR"] = str(MPL_CONFIG)
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.font_manager  # noqa: E402,F401  (builds the font cache: fc-list runs here)


# Where the CLI keeps what it is not told to put elsewhere (RALLYPOINT_STATE_DIR: the runs an embedded `rallypoint
# run` keeps, STATE_DIR/runs): a temporary directory of the session's, not the checkout's .rallypoint/.
# One per process (two tests on two processes may run the same example at once); a RALLYPOINT_STATE_DIR the
# caller set is kept (RALLYPOINT_TESTS_CALLER_STATE_DIR passes it on to the processes of an xdist session).
STATE_DIR = Path(tempfile.mkdtemp(prefix="rallypoint-tests-state-"))
os.environ.setdefault("RALLYPOINT_TESTS_CALLER_STATE_DIR", os.environ.get("RALLYPOINT_STATE_DIR", ""))
os.environ["RALLYPOINT_STATE_DIR"] = os.environ["RALLYPOINT_TESTS_CALLER_STATE_DIR"] or str(STATE_DIR)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_JAX_CACHE:  # the controller, which ends after every xdist process
        shutil.rmtree(JAX_CACHE, ignore_errors=True)
    shutil.rmtree(MPL_CONFIG, ignore_errors=True)
    shutil.rmtree(STATE_DIR, ignore_errors=True)


# A worker in a network namespace of its own (the chaos netns partitions: tests/chaos, the gang's netns test in
# tests/integration/test_gang_runtime.py) reaches no DNS server, and binding its metrics server (http.server calls
# socket.getfqdn on the address) waits out the resolver's default of 2 tries of 5 s before the worker registers:
# 10 s on every netns cluster's start and on every worker restarted in one. One try of 1 s here (glibc's
# RES_OPTIONS, inherited by every process the tests start: the clusters' and the CLIs'). A lookup that has an
# answer is not slower; an RES_OPTIONS of the caller's own is kept.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


SESSION_NOTES: list[str] = []
"""Lines for the end of the session's output (a screenshot's path, why a browser test skipped)."""


# -- the two tiers -----------------------------------------------------------------------------------
# `make check` runs the tests that start no process (`-m "not processes"`); `make test` runs them all.
# A test is marked `processes` when it lives under tests/integration, uses a fixture that starts
# processes (PROCESS_FIXTURES), or says so itself (`@pytest.mark.processes`, or a module's `pytestmark`).
# Every other test runs with process creation refused: one that starts a process without the mark
# fails, in both tiers, naming the mark, so the fast tier cannot silently come to start processes.

PROCESS_FIXTURES = frozenset({"etcd", "store", "local_cluster"})
PROCESS_DIRS = ("integration",)
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        top = Path(item.fspath).resolve().relative_to(TESTS).parts[0]
        if top in PROCESS_DIRS or PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _heavy_modules_first(items)


def _heavy_modules_first(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test TEST_PROCS=2`: ``--dist loadfile`` hands whole modules to its processes in
    collection order), the long modules first and the quick ones last, so that the quick ones fill in at the end
    instead of one process running a long module alone: the modules of clusters and jobs (tests/integration,
    tests/chaos) with the most tests that start processes, then the other modules that start processes, then the
    rest. A module's tests keep their order."""
    count: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        count[module] = count.get(module, 0) + (1 if item.get_closest_marker("processes") else 0)

    def rank(item: pytest.Item) -> tuple[int, int]:
        module = item.nodeid.split("::", 1)[0]
        jobs = Path(module).parts[1:2] in (("integration",), ("chaos",))
        return (0 if jobs and count[module] else 1 if count[module] else 2), -count[module]

    items.sort(key=rank)  # stable: ties keep collection order


class ProcessRefused(RuntimeError):
    pass


_SPAWNERS = [(subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "posix_spawn"),
             (os, "posix_spawnp"), (os, "fork")]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    return (yield from _refusing_processes(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    return (yield from _refusing_processes(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    return (yield from _refusing_processes(item))


def _refusing_processes(item: pytest.Item) -> Any:
    """Run one phase of ``item``; unless it is marked ``processes``, no process may start in it."""
    if item.get_closest_marker("processes"):
        return (yield)
    tried: list[str] = []

    def refuse(name: str) -> Callable[..., Any]:
        def spawner(*args: Any, **kwargs: Any) -> Any:
            tried.append(name)
            raise ProcessRefused(f"{item.nodeid} started a process ({name}) but is not marked "
                                 "`processes`: mark it (@pytest.mark.processes) so that `make check` leaves it out")
        return spawner

    saved = [(mod, name, getattr(mod, name)) for mod, name in _SPAWNERS if hasattr(mod, name)]
    for mod, name, _ in saved:
        setattr(mod, name, refuse(f"{mod.__name__}.{name}"))
    try:
        result = yield
    finally:
        for mod, name, original in saved:
            setattr(mod, name, original)
    if tried:  # also when the test caught the error
        raise ProcessRefused(f"{item.nodeid} started a process ({', '.join(tried)}) but is not marked `processes`: "
                             "mark it (@pytest.mark.processes) so that `make check` leaves it out")
    return result


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SESSION_NOTES:
        terminalreporter.write_sep("-", "notes")
        for line in SESSION_NOTES:
            terminalreporter.write_line(line)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A single-member etcd (50 ms heartbeat, 500 ms election: 1 s TTLs allowed), on plain http without auth:
    tests of the store and of single components; every local cluster runs etcd with TLS and auth."""
    cluster = EtcdCluster.start(members=1, base_dir=tmp_path / "etcd", tls=None)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def store(etcd: EtcdCluster) -> Iterator[EtcdStore]:
    s = EtcdStore(etcd.endpoints, tls=None)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One JAX compilation cache for every cluster the session starts (``--compile-cache-dir``): a program
    compiled by one test's workers is loaded by the next test's, as a restarted worker loads it from a cluster's
    own cache. tests/workers/test_compile_cache.py checks the cache itself, from cold."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # shared by the session's xdist processes: each basetemp's parent
        shared = tmp_path_factory.getbasetemp().parent / "compile-cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture
def local_cluster(tmp_path: Path, compile_cache: Path) -> Iterator[Callable[..., LocalCluster]]:
    """Factory for local clusters of real processes; every process is stopped and checked gone."""
    started: list[LocalCluster] = []

    def start(**overrides: Any) -> LocalCluster:
        settings: dict[str, Any] = {
            "workers": 2, "spares": 0, "devices_per_worker": 1, "coordinators": 2, "lease_ttl_s": 2,
            "compile_cache_dir": compile_cache,
        } | overrides
        cfg = LocalClusterConfig(state_dir=tmp_path / f"cluster{len(started)}", **settings)
        lc = LocalCluster.start(cfg)
        started.append(lc)
        return lc

    try:
        yield start
    finally:
        for lc in started:
            stop_cluster(lc)
            left = [p for p in lc.processes if is_running(p)]
            assert not left, f"processes left running: {left}"


def stop_cluster(lc: LocalCluster) -> None:
    """:meth:`LocalCluster.stop`: workers, then coordinators, then etcd, the processes of a role together."""
    lc.stop()


def read_events(log_path: str | Path, event: str | None = None) -> list[dict[str, Any]]:
    """JSON log events of one process log (non-JSON lines skipped), optionally of one name."""
    out = []
    try:
        text = Path(log_path).read_text(errors="replace")
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event is None or rec.get("event") == event:
            out.append(rec)
    return out


def wait_until(pred: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something truthy; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
