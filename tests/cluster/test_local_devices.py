"""`rallypoint up --platform`: how a host's devices split among a local cluster's workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rallypoint.basics.errors import ConfigError
from rallypoint.cluster.local_devices import plan_devices


def test_cpu_workers_make_their_own_devices() -> None:
    plan = plan_devices("cpu", processes=3, devices_per_worker=None, host_devices=None)
    assert plan.devices_per_worker == 2 and plan.env == ({}, {}, {}) and not plan.shared


def test_a_gpu_host_with_enough_devices_gives_each_worker_its_own() -> None:
    plan = plan_devices("cuda", processes=4, devices_per_worker=None, host_devices=8)
    assert plan.devices_per_worker == 2 and not plan.shared
    assert [e["CUDA_VISIBLE_DEVICES"] for e in plan.env] == ["0,1", "2,3", "4,5", "6,7"]
    assert plan_devices("rocm", processes=2, devices_per_worker=1, host_devices=2).env == \
        ({"HIP_VISIBLE_DEVICES": "0"}, {"HIP_VISIBLE_DEVICES": "1"})


def test_one_gpu_box_shares_its_device_among_the_workers() -> None:
    plan = plan_devices("cuda", processes=5, devices_per_worker=None, host_devices=1)
    assert plan.devices_per_worker == 1 and plan.shared and plan.env == ({},) * 5
    assert "sharing" in plan.describe()


def test_what_does_not_fit_is_refused_naming_what_to_give() -> None:
    with pytest.raises(ConfigError, match="--devices-per-worker 4 but this host has 2 cuda devices"):
        plan_devices("cuda", processes=1, devices_per_worker=4, host_devices=2)
    with pytest.raises(ConfigError, match="one worker"):
        plan_devices("tpu", processes=2, devices_per_worker=None, host_devices=4)
    with pytest.raises(ConfigError, match="JAX finds no cuda devices"):
        plan_devices("cuda", processes=1, devices_per_worker=None, host_devices=0)


@pytest.mark.processes
def test_up_on_a_platform_this_host_lacks_exits_1_and_starts_nothing(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "rallypoint.cli", "up", "--platform", "cuda", "--state-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out
    assert "JAX finds no cuda devices on this host" in out.stderr and "--platform cpu" in out.stderr
    assert not (tmp_path / "cluster.json").exists()
