"""What the client layer may use of the orchestrator, in one place.

The client (``rallypoint.client``: the job's client and the operator's commands) reads the same
facts the leader writes: the device leases (cordon, uncordon, release), a job's events and how a
job ends, and the run directories with their files (``metrics.jsonl``, ``events.jsonl``, the run
ids). It imports them from here and from nowhere else in the orchestrator (an import-linter
contract in ``.importlinter``), so the executor, the service and the control plane stay free to
change shape behind these names.
"""

from __future__ import annotations

from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import Store
from rallypoint.orchestrator.control.devices import DeviceLeases
from rallypoint.orchestrator.job.metrics import MetricsRun, read_metrics
from rallypoint.orchestrator.job.recovery import JobSettings
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.orchestrator.job.sinks import TensorBoardSink
from rallypoint.orchestrator.job.record import EVENTS_FILE
from rallypoint.orchestrator.job.runs import RUN_ID, check_run_id, delete_run, old_runs, run_dir, run_of
from rallypoint.orchestrator.job.state import END_EVENTS, FINAL_RECORD_STATES

__all__ = ["END_EVENTS", "EVENTS_FILE", "FINAL_RECORD_STATES", "RUN_ID", "MetricsRun", "check_run_id", "check_settings",
           "cordon",
           "delete_run", "old_runs", "read_metrics", "release", "run_dir", "run_of", "uncordon", "TensorBoardSink"]


def check_settings(spec: pb.JobSpec) -> None:
    """Refuse the recovery and integrity settings of ``spec`` as the coordinator would, before anything starts.

    Raises:
        ValueError: a setting out of range, or settings that do not fit together; the message names them.
    """
    JobSettings.from_spec(spec)


def cordon(store: Store, keys: Keys, worker: str, *, by: str = "operator") -> None:
    """No new device leases on ``worker``; its current leases stay. ``by``: who asked (an operator, a drain)."""
    DeviceLeases(store, keys).cordon(worker, by=by)


def uncordon(store: Store, keys: Keys, worker: str) -> bool:
    """New device leases on ``worker`` again; False when it was not cordoned."""
    return DeviceLeases(store, keys).uncordon(worker)


def release(store: Store, keys: Keys, job: str, slice_name: str | None = None) -> int:
    """Release the device leases ``job`` (or its slice ``slice_name``) holds; the number of devices released."""
    return DeviceLeases(store, keys).release(job, slice_name)
