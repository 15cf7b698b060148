"""A worker's platform: the settings it makes before JAX starts, what it registers, the device
memory it reports (docs/platforms.md). No processes: the registration goes to a MemoryStore.

This machine has CPU devices only; a GPU's devices are stood in for by objects with the
attributes JAX's devices have (``platform``, ``device_kind``, ``client.platform_version``,
``memory_stats()``), to pin down how they are named and reported. The real CPU devices are
used wherever they can answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import jax
import pytest

from rallypoint.basics.errors import ConfigError
from rallypoint.etcd.keys import Keys
from rallypoint.workers.config import WorkerConfig
from rallypoint.workers.daemon import WorkerDaemon
from rallypoint.workers.metrics import device_memory_metrics
from rallypoint.workers.platform import (DETERMINISTIC_FLAG, PlatformInfo, check_platform, device_record,
                                         export_platform, gpu_deterministic, platform_info, prepare_environment)
from tests.fakes import MemoryStore

GIB = 2**30


@dataclass
class GpuLike:
    """What the worker reads of a CUDA device (jaxlib's names)."""

    id: int
    stats: dict[str, int] = field(default_factory=lambda: {"bytes_limit": 80 * GIB, "bytes_in_use": 3 * GIB,
                                                            "peak_bytes_in_use": 5 * GIB})
    platform: str = "gpu"
    device_kind: str = "NVIDIA H100 80GB HBM3"
    client: Any = field(default_factory=lambda: SimpleNamespace(platform_version="cuda 12040"))

    def memory_stats(self) -> dict[str, int]:
        return self.stats


def test_before_jax_starts_a_worker_turns_off_preallocation_and_on_deterministic_gpu_kernels() -> None:
    env: dict[str, str] = {}
    assert prepare_environment("", environ=env) == env
    assert env == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_FLAGS": DETERMINISTIC_FLAG}
    assert gpu_deterministic(env["XLA_FLAGS"])
    # Pinned: JAX_PLATFORMS, also for the processes it starts; the GPU flag only where GPU kernels may run.
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    prepare_environment("cuda", environ=env)
    assert env["JAX_PLATFORMS"] == "cuda" and env["XLA_FLAGS"] == f"--xla_dump_to=/tmp/d {DETERMINISTIC_FLAG}"
    env = {}
    prepare_environment("cpu", environ=env)
    assert env == {"JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    # The operator's own settings stand, and so does an opt-out.
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_FLAGS": "--xla_gpu_deterministic_ops=false"}
    assert prepare_environment("gpu", environ=env) == {"JAX_PLATFORMS": "gpu"}
    assert not gpu_deterministic(env["XLA_FLAGS"])
    env = {}
    prepare_environment("", deterministic=False, environ=env)
    assert "XLA_FLAGS" not in env
    with pytest.raises(ConfigError, match="unknown platform 'metal'.*cpu, cuda, rocm, tpu, gpu"):
        check_platform("metal")


def test_gpu_devices_report_cuda_their_kind_memory_and_whether_kernels_are_deterministic() -> None:
    devs = [GpuLike(0), GpuLike(1)]
    assert export_platform(devs[0]) == "cuda"  # jax.export's name, what an exported program records
    assert export_platform(GpuLike(0, client=SimpleNamespace(platform_version="rocm 6.0"))) == "rocm"
    info = platform_info(devs, xla_flags=f"--foo {DETERMINISTIC_FLAG}")
    assert info == PlatformInfo(platform="cuda", device_kind="NVIDIA H100 80GB HBM3", memory_bytes=80 * GIB,
                                deterministic=True)
    assert not platform_info(devs, xla_flags="").deterministic
    assert device_record(1, devs[1]) == {"index": 1, "platform": "cuda", "kind": "NVIDIA H100 80GB HBM3",
                                         "memory_bytes": 80 * GIB}


def test_cpu_devices_report_cpu_no_device_memory_and_deterministic_kernels() -> None:
    devs = jax.local_devices()[:2]
    info = platform_info(devs, xla_flags="")
    assert info == PlatformInfo(platform="cpu", device_kind="cpu", memory_bytes=0, deterministic=True)
    assert device_record(0, devs[0]) == {"index": 0, "platform": "cpu", "kind": "cpu", "memory_bytes": 0}


def test_the_registration_records_platform_kind_memory_and_determinism() -> None:
    store, keys = MemoryStore(), Keys("t")
    d = WorkerDaemon(WorkerConfig(cluster="t", worker_id="w1", endpoints=("127.0.0.1:1",), devices=2,
                                  discover_devices=False, platform="GPU"), store=store)
    assert d.config.platform == "gpu"
    d.devices = [device_record(i, g) for i, g in enumerate([GpuLike(0), GpuLike(1)])]
    d.platform = platform_info([GpuLike(0), GpuLike(1)], xla_flags="")
    d.address = "127.0.0.1:7001"
    try:
        d.register()
        record = store.get(keys.worker("w1")).json()
        assert {k: record[k] for k in ("platform", "device_kind", "device_memory_bytes", "deterministic")} == {
            "platform": "cuda", "device_kind": "NVIDIA H100 80GB HBM3", "device_memory_bytes": 80 * GIB,
            "deterministic": False}
        devices = [kv.json() for kv in store.get_prefix(keys.worker_devices("w1"))[0]]
        assert sorted(x["index"] for x in devices) == [0, 1]
        assert all(x["platform"] == "cuda" and x["memory_bytes"] == 80 * GIB for x in devices)
    finally:
        d.stop()


def _samples(daemon: Any) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels["device"]): s.value for m in device_memory_metrics(daemon) for s in m.samples}


def test_device_memory_in_use_and_peak_are_worker_metrics_where_the_platform_reports_them() -> None:
    gpus = [GpuLike(0), GpuLike(1, stats={"bytes_limit": 80 * GIB, "bytes_in_use": GIB, "peak_bytes_in_use": 2 * GIB})]
    daemon = SimpleNamespace(devices=[{}, {}], jax_devices=lambda: gpus)
    got = _samples(daemon)
    assert got[("rallypoint_worker_device_memory_in_use_bytes", "0")] == 3 * GIB
    assert got[("rallypoint_worker_device_memory_peak_bytes", "1")] == 2 * GIB
    assert got[("rallypoint_worker_device_memory_limit_bytes", "1")] == 80 * GIB
    # JAX's CPU devices keep no memory statistics: the families are there, with no made-up samples.
    cpu = SimpleNamespace(devices=[{}, {}], jax_devices=lambda: jax.local_devices()[:2])
    assert _samples(cpu) == {}
    assert {m.name for m in device_memory_metrics(cpu)} == {
        "rallypoint_worker_device_memory_in_use_bytes", "rallypoint_worker_device_memory_peak_bytes",
        "rallypoint_worker_device_memory_limit_bytes"}
