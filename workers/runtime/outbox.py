"""What a loaded job sends to other workers: each value logged, then pushed.

:class:`Outbox` owns the job's output log (:mod:`rallypoint.workers.runtime.outlog`: every value
sent to another worker stays there until the consistent cut passes it, so a
recovery can send it again) and its push pools (:class:`rallypoint.workers.transfer.PushPools`:
one per consumer worker incarnation, so a stuck peer holds up no other). A push
retries while this worker is fenced and ends when the job is unloaded or recovery
moved its consumer away (:meth:`Outbox.keep_only`); the log still holds the value.
Values for consumers on this worker never come here: the router hands them over
in memory (:mod:`rallypoint.workers.runtime.routes`).

Nothing here grows without bound when a consumer is slow or stops reading: a push
waiting for its turn keeps its value alive even after the log spilled it, so the
outbox counts the bytes of pushes not yet ended (``backlog_bytes``) and the producer
starts no new instance while they exceed the log's limit (:attr:`Outbox.backlogged`,
back-pressure; the slice scheduler waits on it). A value is logged and pushed as one
:class:`~rallypoint.workers.residency.HostCopy`: the first push copies it off the device
on its own thread (the slice's loop goes on with its next instance meanwhile), the
other pushes and the log share that copy. The log's spills write files, so
they happen outside the job's lock: on the push threads after each push, and on the
producer's own device thread after each instance (:meth:`Outbox.relieve`), which keeps
the bound when the pushes have not spilled enough (a slow disk slows the producer, not
the job's calls). In the steady state the push threads do the spilling, down to a mark a
quarter of the limit below it, so the slice's loop does not wait for the disk.
"""

from __future__ import annotations

from collections.abc import Callable

from rallypoint.basics.errors import RallypointError
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.gang.lead import on_gang
from rallypoint.workers.runtime.outlog import OutputLog
from rallypoint.workers.residency import Copies, HostCopy, host_copy
from rallypoint.workers.runtime.control import JobControl
from rallypoint.workers.runtime.state import Leaves
from rallypoint.workers.transfer import NotAllowed, PeerChannels, PushPools


class Outbox:
    """The output log and the pushes of one job on this worker.

    Owns ``outlog`` (trimmed by the runtime at each new cut, read back by ``rewire``),
    the push pools and ``targets``: the consumer worker incarnations the routing table
    names now (pushes towards any other are cancelled).

    Args:
        control: the job's control (the gate each push attempt passes; ``stopped``).
        outlog: the job's output log, owned from here on.
        peers: the worker's channels to its peers.
        push_threads: threads per consumer worker incarnation.
        copies: where the job's host-device copies are counted (None: not counted).
    """

    def __init__(self, control: JobControl, outlog: OutputLog, peers: PeerChannels, push_threads: int,
                 copies: Copies | None = None) -> None:
        self._control = control
        self.copies = copies
        self.outlog = outlog
        self._peers = peers
        self._pools = PushPools(control.job, push_threads)
        self.targets: set[tuple[str, int]] = set()
        self.backlog_bytes = 0  # bytes of pushes submitted and not yet ended (under the job's lock)
        self.backlog_limit = max(outlog.limit_bytes, 1)
        self.peak_backlog_bytes = 0

    @property
    def backlogged(self) -> bool:
        """Whether the pushes not yet ended hold more bytes than the limit (the producer waits). Under the lock."""
        return self.backlog_bytes > self.backlog_limit

    def keep_only(self, targets: set[tuple[str, int]]) -> None:
        """The routing table now names these consumer incarnations: pushes to any other end."""
        self.targets = targets
        self._pools.keep_only(targets)

    def send(self, r: pb.Route, header: pb.TransferHeader, value: Leaves | HostCopy, *, log: bool = True) -> None:
        """Log ``value`` and push it to the consumer ``r`` names on another worker (in the background). Under the lock.

        ``log=False``: the value is in the log already (a resend). The log may go over its
        limit here; :meth:`relieve` spills it once no lock is held.
        """
        value = host_copy(value, self.copies)
        if log:
            self.outlog.put(header, value)
        nbytes = value.nbytes
        self.backlog_bytes += nbytes
        self.peak_backlog_bytes = max(self.peak_backlog_bytes, self.backlog_bytes)
        future = self._pools.submit((r.worker_id, int(r.incarnation)), self._push, r.data_address or r.address,
                                    header, value, bool(r.data_address))
        future.add_done_callback(lambda _f, n=nbytes: self._ended(n))

    def _ended(self, nbytes: int) -> None:
        """A push ended (delivered, given up or cancelled): its bytes no longer hold the producer back."""
        with self._control.cv:
            self.backlog_bytes -= nbytes
            self._control.cv.notify_all()

    def relieve(self, *, off_path: bool = False) -> None:
        """Spill the output log back within its limit; call it holding no lock (it writes files).

        ``off_path``: called on a push thread, which nothing waits for: it spills down to the log's low mark,
        leaving the producer's next values room under the limit.
        """
        try:  # the producer's spill settles: the bound holds for the bytes in memory
            self.outlog.spill(self.outlog.low_mark if off_path else None, settle=not off_path)
        except OSError as exc:  # kept in memory: a later spill tries again
            self._control.log.warning("outlog.spill_failed", error=f"{type(exc).__name__}: {exc}")

    def flush(self, timeout_s: float) -> bool:
        """Wait until every push submitted so far has ended; whether they all did."""
        done, left = self._pools.wait_idle(timeout_s)
        if not done:
            self._control.log.warning("job.flush_timed_out", pending=left, timeout_s=timeout_s)
        return done

    def shutdown(self) -> None:
        """End every push (the job was unloaded)."""
        self._pools.shutdown()

    def _push(self, address: str, header: pb.TransferHeader, value: HostCopy, data_plane: bool) -> None:
        control = self._control
        gang = on_gang(value) if data_plane else None
        if gang is not None:  # a multi-host slice's output: each member sends its own shards (workers/gang/pieces.py)
            leaves: Leaves = value.leaves()
            send: Callable[[], bool] | None = lambda: gang.send(leaves, address, header)  # noqa: E731
        else:
            leaves = value.get("transfer")  # off the device here, on the push's thread (once for all its pushes)
            send = None

        def may_act() -> None:
            try:
                control.admit()
            except RallypointError as exc:
                raise NotAllowed(str(exc)) from exc

        target = (header.to.worker_id, header.to.incarnation)

        def cancelled() -> bool:  # unloaded, or recovery moved the consumer (the log holds the value)
            return control.stopped or target not in self.targets

        self._peers.push(address, header, leaves, may_act=may_act, cancelled=cancelled, log=control.log,
                         data_plane=data_plane, send=send)
        self.relieve(off_path=True)  # spill here, off the slice's loop: it then rarely finds the log over its limit
