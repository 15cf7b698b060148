"""What a worker's devices are: the platform, device kind and memory, the settings JAX
needs before it starts its backends, and the local devices a worker finds through JAX
(:func:`discover_local_devices`; docs/platforms.md).

A worker uses the platform JAX finds, or the one its operator pins (``--platform``).
Before JAX starts a backend, :func:`prepare_environment` makes the process's settings:

- ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (unless the operator set it), so a spare on a GPU
  does not take 75 % of the device memory before it is given any work;
- on GPU, ``--xla_gpu_deterministic_ops=true`` appended to ``XLA_FLAGS`` (unless the operator
  opts out, or set it already), so a replayed instance computes bitwise what it computed the
  first time: bitwise recovery rests on it (docs/platforms.md).

Platforms are named as :func:`jax.export.export` names them (``cpu``, ``cuda``, ``rocm``,
``tpu``): the names an exported program records, so the coordinator compares the two as
strings, without JAX. ``gpu`` is an alias (``cuda`` or ``rocm``, whichever is present).
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from rallypoint.basics.errors import ConfigError

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
"""Platform names as ``jax.export`` records them in a program."""
PLATFORM_CHOICES = (*PLATFORMS, "gpu")
"""What ``--platform`` accepts (``gpu``: CUDA or ROCm, whichever JAX finds)."""
GPU_PLATFORMS = frozenset({"cuda", "rocm", "gpu"})
DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"
"""XLA:GPU's switch to deterministic kernels (no atomics in reductions and scatters, no
autotuning between kernels that differ in rounding). A superset of
``--xla_gpu_exclude_nondeterministic_ops``; present in the jaxlib this project pins."""
_DETERMINISTIC_RE = re.compile(r"--xla_gpu_deterministic_ops(?:=(\w+))?")
PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"


@dataclass(frozen=True, kw_only=True)
class PlatformInfo:
    """What a worker tells the cluster about its devices (its etcd record, docs/keys.md).

    Attributes:
        platform: the export name of its devices' platform (:data:`PLATFORMS`).
        device_kind: JAX's ``device_kind`` of its first device (``cpu``, ``NVIDIA H100 80GB HBM3``, ...).
        memory_bytes: each device's memory limit (``memory_stats()['bytes_limit']``); 0 where the
            platform reports none (CPU devices share the host's RAM).
        deterministic: its kernels are deterministic (CPU and TPU always; a GPU with
            :data:`DETERMINISTIC_FLAG` in ``XLA_FLAGS``).
    """

    platform: str
    device_kind: str
    memory_bytes: int
    deterministic: bool

    def to_record(self) -> dict[str, Any]:
        return {"platform": self.platform, "device_kind": self.device_kind,
                "device_memory_bytes": self.memory_bytes, "deterministic": self.deterministic}


def check_platform(platform: str) -> str:
    """``platform`` lowercased if ``--platform`` accepts it ("" too: JAX chooses).

    Raises:
        ConfigError: an unknown platform, naming the known ones.
    """
    p = platform.strip().lower()
    if p and p not in PLATFORM_CHOICES:
        raise ConfigError(f"unknown platform {platform!r}: give one of {', '.join(PLATFORM_CHOICES)} "
                          "(or none: the platform JAX finds)")
    return p


def gpu_deterministic(xla_flags: str) -> bool:
    """Whether ``xla_flags`` (an ``XLA_FLAGS`` value) turns XLA:GPU's deterministic kernels on (the last mention wins)."""
    found = _DETERMINISTIC_RE.findall(xla_flags)
    return bool(found) and found[-1].lower() in ("", "true", "1")


def prepare_environment(platform: str = "", *, deterministic: bool = True,
                        environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set what JAX reads when it starts a backend (call it before any JAX operation); returns what it set.

    ``platform``: pin JAX to it (``JAX_PLATFORMS``, also for the processes this one starts);
    "" leaves the choice to JAX (or to ``JAX_PLATFORMS`` as the operator set it).
    ``deterministic``: append :data:`DETERMINISTIC_FLAG` to ``XLA_FLAGS`` unless ``XLA_FLAGS``
    already says either way, or the platform is pinned to one without GPU kernels (``cpu``,
    ``tpu``). Unpinned, it is appended whatever JAX will find: XLA:CPU parses and ignores it.
    """
    env = os.environ if environ is None else environ
    changed: dict[str, str] = {}
    p = check_platform(platform)
    if p:
        changed["JAX_PLATFORMS"] = p
    if PREALLOCATE_ENV not in env:
        changed[PREALLOCATE_ENV] = "false"
    flags = env.get("XLA_FLAGS", "")
    if deterministic and p not in ("cpu", "tpu") and not _DETERMINISTIC_RE.search(flags):
        changed["XLA_FLAGS"] = f"{flags} {DETERMINISTIC_FLAG}".strip()
    env.update(changed)
    return changed


def pin_jax_platform(platform: str) -> None:
    """Pin JAX (already imported: its ``jax_platforms`` default was read then) to ``platform``, before a backend starts."""
    p = check_platform(platform)
    if not p:
        return
    import jax

    try:
        jax.config.update("jax_platforms", p)
    except RuntimeError as exc:  # a backend already started
        raise ConfigError(f"cannot pin the platform to {p!r}: JAX already started its backends ({exc})") from exc


def export_platform(device: Any) -> str:
    """The name ``jax.export`` gives ``device``'s platform (``gpu`` -> ``cuda`` or ``rocm``)."""
    p = str(device.platform).lower()
    if p == "gpu":
        version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "cuda"
    return p


def memory_stats(device: Any) -> dict[str, int]:
    """``device.memory_stats()`` as ints ({} where the platform keeps none, as on CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without the call, or one that refuses it: report nothing
        return {}
    return {k: int(v) for k, v in (stats or {}).items() if isinstance(v, int | float)}


def platform_info(devices: Sequence[Any], *, xla_flags: str | None = None) -> PlatformInfo:
    """The :class:`PlatformInfo` of a worker's local ``devices`` (one platform: JAX gives one backend's devices)."""
    if not devices:
        raise ConfigError("a worker needs at least 1 device")
    first = devices[0]
    platform = export_platform(first)
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    limits = [memory_stats(d).get("bytes_limit", 0) for d in devices]
    return PlatformInfo(platform=platform, device_kind=str(first.device_kind), memory_bytes=min(limits),
                        deterministic=gpu_deterministic(flags) if platform in GPU_PLATFORMS else True)


def device_record(index: int, device: Any) -> dict[str, Any]:
    """One device's etcd record (``devices/<worker>/<index>``, docs/keys.md)."""
    return {"index": index, "platform": export_platform(device), "kind": str(device.device_kind),
            "memory_bytes": memory_stats(device).get("bytes_limit", 0)}


def discover_local_devices(count: int, platform: str = "") -> list[dict[str, Any]]:
    """The records of the first ``count`` local JAX devices (docs/keys.md ``devices/``).

    ``platform`` pins JAX to it; "" takes what JAX finds (its default backend). On a CPU host
    JAX is asked for ``count`` CPU devices. Call :func:`prepare_environment`
    first (memory preallocation, deterministic kernels): JAX reads it when a backend starts.

    Raises:
        ConfigError: JAX sees fewer devices than ``count``, or cannot pin ``platform``.
    """
    pin_jax_platform(platform)
    import jax

    if jax.config.jax_num_cpu_devices < count:
        try:
            jax.config.update("jax_num_cpu_devices", count)
        except RuntimeError:
            pass  # JAX already started in this process: take what it has (checked below)
    try:
        devs = jax.local_devices()
    except RuntimeError as exc:  # e.g. --platform cuda on a host without a CUDA jaxlib or GPU
        raise ConfigError(f"JAX found no devices of platform {platform or 'any'!r}: {exc}") from exc
    if len(devs) < count:
        raise ConfigError(f"asked for {count} devices but JAX sees {len(devs)}: {devs}; lower --devices")
    return [device_record(i, d) for i, d in enumerate(devs[:count])]
