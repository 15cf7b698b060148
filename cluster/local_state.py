"""The local cluster's state file, ``<state-dir>/cluster.json``.

``rallypoint up`` records there what it started (the config, etcd's endpoints, every
process as a :class:`~rallypoint.cluster.processes.ProcessRecord`, and each worker's
:class:`~rallypoint.cluster.local_config.WorkerNetwork` when not on loopback), so that
``rallypoint down`` and other commands find the cluster again. Written atomically
(a temporary file, then a rename).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rallypoint.basics.errors import ClusterNotFound
from rallypoint.cluster.local_config import LocalClusterConfig, WorkerNetwork
from rallypoint.cluster.processes import ProcessRecord
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from rallypoint.workers.faults import WorkerFaults

STATE_FILE = "cluster.json"


def state_file(state_dir: Path) -> Path:
    return state_dir / STATE_FILE


def write_state(config: LocalClusterConfig, endpoints: list[str], processes: list[ProcessRecord],
                worker_networks: dict[str, WorkerNetwork]) -> None:
    """Record a cluster in ``config.state_dir``."""
    data = {
        "cluster": config.cluster,
        "endpoints": endpoints,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "processes": [asdict(p) for p in processes],
    }
    if worker_networks:
        data["worker_networks"] = {w: asdict(n) for w, n in worker_networks.items()}
    path = state_file(config.state_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def read_state(state_dir: Path) -> tuple[LocalClusterConfig, list[str], list[ProcessRecord],
                                         dict[str, WorkerNetwork]]:
    """The cluster recorded in ``state_dir``: ``(config, endpoints, processes, worker networks)``.

    Raises:
        ClusterNotFound: none is recorded there.
    """
    path = state_file(state_dir)
    if not path.exists():
        raise ClusterNotFound(
            f"no cluster recorded in {state_dir}: start one with `rallypoint up --state-dir {state_dir}`, "
            "or pass --cluster NAME@HOST:PORT"
        )
    data = json.loads(path.read_text())
    cfg: dict[str, Any] = data["config"] | {"state_dir": Path(data["config"]["state_dir"])}
    if "worker_faults" in cfg:
        cfg["worker_faults"] = WorkerFaults(**cfg["worker_faults"])
    if "coordinator_hooks" in cfg:
        cfg["coordinator_hooks"] = ExecutorHooks(**cfg["coordinator_hooks"])
    nets = {w: WorkerNetwork(**(n | {"prefix": tuple(n["prefix"]), "endpoints": tuple(n["endpoints"])}))
            for w, n in data.get("worker_networks", {}).items()}
    return LocalClusterConfig(**cfg), data["endpoints"], [ProcessRecord(**p) for p in data["processes"]], nets
