"""The one root exception of Rallypoint and its structured subclasses.

Every error a user or operator can see derives from :class:`RallypointError`.
Messages name what is wrong and, where there is one, the setting to change.
"""

from __future__ import annotations


class RallypointError(Exception):
    """Root of every Rallypoint error."""


class ConfigError(RallypointError):
    """A configuration value is invalid; the message names the setting."""


class EtcdBinaryNotFound(RallypointError):
    """No etcd server binary could be found."""


class EtcdStartError(RallypointError):
    """An etcd member did not become ready."""


class StoreError(RallypointError):
    """A request to the coordination store failed."""


class StoreUnavailable(StoreError):
    """The store could not be reached: a transient failure, worth retrying.

    Raised as is, the request did not apply; the subclass
    :class:`WriteIndeterminate` marks a write that may have.
    """


class WriteIndeterminate(StoreUnavailable):
    """A write timed out or lost its connection: it may or may not have applied.

    A :class:`StoreUnavailable` (callers retry both as transient), but callers must
    re-read (or make the write idempotent with a compare) before acting on the
    assumption that it did not apply.
    """


class WatchCompacted(StoreError):
    """A watch asked for a revision that etcd has already compacted."""

    def __init__(self, requested_revision: int, compact_revision: int) -> None:
        super().__init__(
            f"watch from revision {requested_revision} is no longer possible: etcd "
            f"compacted history up to revision {compact_revision}; re-read the "
            "current state and watch from its revision + 1"
        )
        self.requested_revision = requested_revision
        self.compact_revision = compact_revision


class LeaseNotFound(StoreError):
    """The etcd lease named in a request no longer exists (expired or revoked)."""

    def __init__(self, lease_id: int) -> None:
        super().__init__(f"etcd lease {lease_id:x} no longer exists (expired or revoked)")
        self.lease_id = lease_id


class Fenced(RallypointError):
    """This process may no longer act under its identity (lease lost or expired locally)."""

    def __init__(self, who: str, reason: str) -> None:
        super().__init__(f"{who} is fenced: {reason}")
        self.who = who
        self.reason = reason


class NotLeader(Fenced):
    """A fenced leader write was refused: this coordinator no longer leads."""


class AllocationError(RallypointError):
    """Devices could not be leased for a virtual slice."""


class NoSpareDevices(AllocationError):
    """No free worker has enough devices for the requested slice."""

    def __init__(self, job: str, slice_name: str, devices: int, largest_free: int) -> None:
        super().__init__(
            f"no spare worker has {devices} free devices for slice {slice_name!r} of job "
            f"{job!r} (largest free: {largest_free}); start more workers, uncordon one "
            "(`rallypoint uncordon WORKER`), or release a job's devices"
        )
        self.job = job
        self.slice_name = slice_name
        self.devices = devices
        self.largest_free = largest_free


class ClusterNotFound(RallypointError):
    """No running cluster could be found from the state dir or --cluster."""


class UnknownWorker(RallypointError):
    """A command named a worker that is not registered."""
