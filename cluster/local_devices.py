"""The devices of a local cluster's host, split among its workers (``rallypoint up --platform``).

On ``cpu`` (the default) each worker asks JAX for its own K CPU devices: nothing to split. On a
GPU host the workers are processes on the same devices, so each is given its own K of them
through the platform's visibility variable (``CUDA_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES``)
when the host has enough for every worker and spare; with fewer (one GPU box trying the
demo's four workers and a spare), every worker sees the same devices and shares them
(device memory is not preallocated: :func:`rallypoint.workers.platform.prepare_environment`).
A TPU host's chips belong to one process: its local cluster runs one worker.

:func:`host_device_count` asks JAX, in a child process (this one must not start a backend: on a
GPU it would take device memory the workers need), how many devices the platform has.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from rallypoint.basics.errors import ConfigError

VISIBLE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "gpu": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES"}
DEFAULT_CPU_DEVICES = 2
COUNT_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class DevicePlan:
    """How a local cluster's workers take the host's devices: K each, and each worker's environment."""

    platform: str
    devices_per_worker: int
    env: tuple[dict[str, str], ...]  # per worker process (workers, then spares): what it is started with
    shared: bool  # the workers share the same devices (fewer on the host than workers x K)

    def describe(self) -> str:
        if self.platform == "cpu":
            return f"{self.devices_per_worker} CPU devices each"
        how = "sharing the host's" if self.shared else "each its own"
        return f"{self.devices_per_worker} {self.platform} devices, {how}"


def plan_devices(platform: str, *, processes: int, devices_per_worker: int | None, host_devices: int | None) -> DevicePlan:
    """The split of ``host_devices`` (None on cpu: not needed) among ``processes`` workers (spares included).

    ``devices_per_worker`` None: on cpu :data:`DEFAULT_CPU_DEVICES`; elsewhere what the platform has, split evenly
    (each worker its own share when there are at least as many devices as workers, else all of them, shared).

    Raises:
        ConfigError: K larger than the host's devices; more than one worker on a TPU host.
    """
    if platform == "cpu":
        return DevicePlan("cpu", devices_per_worker or DEFAULT_CPU_DEVICES, tuple({} for _ in range(processes)), False)
    total = int(host_devices or 0)
    if total < 1:
        raise ConfigError(f"JAX finds no {platform} devices on this host: give --platform cpu, or install JAX for "
                          f"{platform}")
    if platform == "tpu" and processes > 1:
        raise ConfigError(f"a TPU host's {total} chips belong to one process: a local cluster on tpu runs one worker "
                          "(--workers 1 --spares 0); spares are other hosts")
    k = devices_per_worker or (total // processes if total >= processes else total)
    if k > total:
        raise ConfigError(f"--devices-per-worker {k} but this host has {total} {platform} devices: give at most {total}")
    var = VISIBLE_ENV.get(platform)
    if var is None or k * processes > total:  # fewer devices than workers x K: they share
        return DevicePlan(platform, k, tuple({} for _ in range(processes)), platform != "tpu")
    envs = tuple({var: ",".join(str(d) for d in range(i * k, (i + 1) * k))} for i in range(processes))
    return DevicePlan(platform, k, envs, False)


def host_device_count(platform: str) -> int:
    """How many devices JAX finds on this host for ``platform`` (a child process; 0: none, or JAX cannot use it)."""
    env = {**os.environ, "JAX_PLATFORMS": platform, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        out = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices()))"], env=env,
                             capture_output=True, text=True, timeout=COUNT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"could not ask JAX for the {platform} devices of this host: {exc}") from exc
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or ["no reason given"])[-1]
        raise ConfigError(f"JAX finds no {platform} devices on this host ({why[:300]}): give --platform cpu, or "
                          f"install JAX for {platform}")
    try:
        return int(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ConfigError(f"asking JAX for the {platform} devices printed {out.stdout!r}") from None


def local_plan(platform: str, *, processes: int, devices_per_worker: int | None) -> tuple[DevicePlan, int]:
    """``rallypoint up`` and the embedded ``rallypoint run``: the plan on this host, and its device count (0 on cpu,
    which JAX is not asked for: each worker makes its own CPU devices).

    Raises:
        ConfigError: an unknown platform, one JAX does not find here, or a split that does not fit.
    """
    from rallypoint.workers.platform import check_platform

    p = check_platform(platform) or "cpu"
    host = 0 if p == "cpu" else host_device_count(p)
    return plan_devices(p, processes=processes, devices_per_worker=devices_per_worker, host_devices=host), host
