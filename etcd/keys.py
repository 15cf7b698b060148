"""The etcd key schema: the one place that builds key strings.

Every key of a cluster lives under ``/rallypoint/<cluster>/``::

    workers/<worker>            worker record (JSON), on the worker's etcd lease;
                                its create revision is the worker's incarnation
    devices/<worker>/<index>    one physical device of a live worker, on its lease
    leases/<worker>/<index>     the holder of a device: {job, slice, term}, on the
                                worker's lease, so fencing the worker frees it
    cordon/<worker>             present while the worker takes no new leases: {by, ...}; a straggler
                                move's is on a lease of its probation, so it lapses by itself
    straggler-moves/<worker>    when the worker was last moved off as a straggler: {moves: [wall times]}
    lost/<worker>               last loss of a worker: {incarnation, reason, ...}
    drain/<worker>              a request to move the worker's slices off it (rallypoint.etcd.drains):
                                {reason, by, at, deadline_s}; a preempted worker's is on its own lease
    drained/<worker>/<job>      what the job's leader did with it: {state: done | cancelled, ...}
    yield/<job>/<slice>         a higher-priority job asks ``job`` to give up the slice's devices:
                                {for, priority, at}; removed by the asking job once it is placed
    coordinators/<id>           a running coordinator, on its own lease
    leader                      the elected coordinator, on its lease; its create
                                revision is the leader's term (the fencing token)
    jobs/<job>                  the job record (JSON: state, term, run_dir, placement,
                                cut, failures, recoveries): what a new leader adopts from
    commits/<worker>/<job>/<slice>/<step:012d>
                                a checkpoint commit as the worker that made it wrote it (its own keys: the
                                worker's etcd user may write nothing else of a job); it counts once the leader
                                checked it and promoted it (rallypoint.orchestrator.job.promote)
    jobs/<job>/checkpoints/<slice>/<step:012d>
                                a committed slice checkpoint of the job's current run, promoted by its leader
    jobs/<job>/runs/<run>/record, jobs/<job>/runs/<run>/checkpoints/<slice>/<step:012d>
                                an earlier run of the job name, kept under its run id (rallypoint.orchestrator.job.runs)

See ``docs/keys.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rallypoint.basics.errors import ConfigError

ROOT = "/rallypoint"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def check_name(kind: str, name: str) -> str:
    """Return ``name`` if it is a valid identifier for a key segment, else raise ConfigError."""
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"invalid {kind} name {name!r}: use 1-63 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name


def all_clusters_prefix() -> str:
    """The prefix under which every cluster's keys live."""
    return f"{ROOT}/"


def cluster_of(key: str) -> str:
    """The cluster name a key belongs to."""
    if not key.startswith(all_clusters_prefix()):
        raise ValueError(f"{key!r} is not a Rallypoint key")
    return key[len(all_clusters_prefix()):].split("/")[0]


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder for one cluster."""

    cluster: str

    def __post_init__(self) -> None:
        check_name("cluster", self.cluster)

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.cluster}/"

    # workers and devices
    @property
    def workers(self) -> str:
        return f"{self.prefix}workers/"

    def worker(self, worker: str) -> str:
        return f"{self.workers}{worker}"

    @property
    def devices(self) -> str:
        return f"{self.prefix}devices/"

    def worker_devices(self, worker: str) -> str:
        return f"{self.devices}{worker}/"

    def device(self, worker: str, index: int) -> str:
        return f"{self.worker_devices(worker)}{index}"

    @property
    def leases(self) -> str:
        return f"{self.prefix}leases/"

    def worker_leases(self, worker: str) -> str:
        return f"{self.leases}{worker}/"

    def lease(self, worker: str, index: int) -> str:
        return f"{self.worker_leases(worker)}{index}"

    @property
    def cordons(self) -> str:
        return f"{self.prefix}cordon/"

    def cordon(self, worker: str) -> str:
        return f"{self.cordons}{worker}"

    def straggler_moves(self, worker: str) -> str:
        return f"{self.prefix}straggler-moves/{worker}"

    @property
    def lost_workers(self) -> str:
        return f"{self.prefix}lost/"

    def lost(self, worker: str) -> str:
        return f"{self.lost_workers}{worker}"

    @property
    def drains(self) -> str:
        return f"{self.prefix}drain/"

    def drain(self, worker: str) -> str:
        return f"{self.drains}{worker}"

    def drain_results(self, worker: str) -> str:
        return f"{self.prefix}drained/{worker}/"

    def drain_result(self, worker: str, job: str) -> str:
        return f"{self.drain_results(worker)}{job}"

    @property
    def yields(self) -> str:
        return f"{self.prefix}yield/"

    def job_yields(self, job: str) -> str:
        return f"{self.yields}{job}/"

    def yield_slice(self, job: str, slice_name: str) -> str:
        return f"{self.job_yields(job)}{slice_name}"

    # coordinators
    @property
    def coordinators(self) -> str:
        return f"{self.prefix}coordinators/"

    def coordinator(self, coordinator_id: str) -> str:
        return f"{self.coordinators}{coordinator_id}"

    @property
    def leader(self) -> str:
        return f"{self.prefix}leader"

    # jobs
    @property
    def jobs(self) -> str:
        return f"{self.prefix}jobs/"

    def job(self, job: str) -> str:
        return f"{self.jobs}{job}"

    @property
    def controls(self) -> str:
        return f"{self.prefix}control/"

    def control(self, job: str) -> str:
        """A suspend or cancel asked of the job and not yet carried out (orchestrator/service/verbs.py)."""
        return f"{self.controls}{job}"

    def checkpoints(self, job: str) -> str:
        """Prefix of every checkpoint commit of ``job`` (a prefix read lists them by slice, then step)."""
        return f"{self.job(job)}/checkpoints/"

    def checkpoint(self, job: str, slice_name: str, step: int) -> str:
        """The commit of ``slice_name``'s checkpoint after ``step``; the zero-padded step sorts by number."""
        return f"{self.checkpoints(job)}{slice_name}/{step:012d}"

    @property
    def worker_commits_all(self) -> str:
        """Prefix of every worker's own commits (``commits/<worker>/<job>/<slice>/<step:012d>``)."""
        return f"{self.prefix}commits/"

    def worker_commits(self, worker: str) -> str:
        """Prefix of the commits ``worker`` wrote: the only commit keys its etcd user may write."""
        return f"{self.worker_commits_all}{worker}/"

    def worker_commit(self, worker: str, job: str, slice_name: str, step: int) -> str:
        """``worker``'s own commit of ``slice_name``'s checkpoint after ``step`` (its leader promotes it)."""
        return f"{self.worker_commits(worker)}{job}/{slice_name}/{step:012d}"

    def runs(self, job: str) -> str:
        """Prefix of the job name's earlier runs, each kept under its run id (rallypoint.orchestrator.job.runs)."""
        return f"{self.job(job)}/runs/"

    def old_run(self, job: str, run: str) -> str:
        """The job record of an earlier run, as it was when a new run of the name started."""
        return f"{self.runs(job)}{run}/record"

    def old_run_checkpoints(self, job: str, run: str) -> str:
        """Prefix of an earlier run's commits (``<slice>/<step:012d>``, as they were under ``checkpoints``)."""
        return f"{self.runs(job)}{run}/checkpoints/"

    # parsing
    def tail(self, key: str, under: str) -> list[str]:
        """The path segments of ``key`` below the prefix ``under``."""
        if not key.startswith(under):
            raise ValueError(f"{key!r} is not under {under!r}")
        return key[len(under):].split("/")


def parse_cluster(addr: str) -> tuple[str | None, tuple[str, ...]]:
    """Parse ``[NAME@]HOST:PORT[,HOST:PORT...]``."""
    name, _, rest = addr.rpartition("@")
    endpoints = tuple(e.strip() for e in rest.split(",") if e.strip())
    if not endpoints:
        raise ConfigError(f"--cluster {addr!r}: give etcd endpoints as [NAME@]HOST:PORT[,HOST:PORT...]")
    for ep in endpoints:
        host, _, port = ep.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--cluster {addr!r}: {ep!r} is not HOST:PORT (e.g. 127.0.0.1:2379)")
    if name:
        check_name("cluster", name)
    return name or None, endpoints
