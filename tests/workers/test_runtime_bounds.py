"""Nothing in a worker's runtime waits on a disk under the job's lock, grows without bound
behind a slow consumer, or half-applies a rewire."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rallypoint.client.reference import state_digest
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.dataplane import DataPlaneServer, Status
from rallypoint.workers.runtime.outlog import OutputLog
from rallypoint.workers.runtime.records import InstanceRecords
from rallypoint.workers.runtime.control import JobControl
from rallypoint.workers.runtime.inputs import Inputs
from rallypoint.workers.runtime.load import LoadedNode
from rallypoint.workers.runtime.outbox import Outbox
from rallypoint.workers.runtime.routes import Router
from rallypoint.workers.runtime.scheduler import SliceScheduler
from rallypoint.workers.errors import LoadError
from rallypoint.workers.runtime.state import NodeProgress
from rallypoint.workers.transfer import PeerChannels
from tests.conftest import wait_until
from tests.fakes import FakeOutbox
from tests.helpers.runtime import Worker, compiled_and_reference, load


def test_a_rewire_with_a_rejected_route_leaves_every_route_as_it_was() -> None:
    # fwd.y goes to head on worker "far"; a rewire names a new place for it and a route from
    # a node that is not here: it is refused, and fwd.y still goes to "far" alone.
    control = JobControl("j", cluster="c", worker_id="here", admit=lambda to: None, incarnation=lambda: 3,
                         outlog=OutputLog(1 << 20))
    nodes = {"fwd": LoadedNode(pb.NodeProgram(name="fwd", slice="s", every=1), None, (-1,),  # type: ignore[arg-type]
                               NodeProgress(1, (-1,), 4))}
    outbox = FakeOutbox()
    router = Router(control, nodes, set(), {}, Inputs(control, nodes, {}, steps=4, microbatches=1),
                    outbox, steps=4, start_step=0)  # type: ignore[arg-type]
    old = pb.Route(node="fwd", output="y", consumer_node="head", arg="x", worker_id="far", incarnation=9)
    router.set_routes([old])
    moved = pb.Route(node="fwd", output="y", consumer_node="head", arg="x", worker_id="new", incarnation=1)
    with pytest.raises(LoadError, match="'gone', which is not loaded"):
        router.set_routes([moved, pb.Route(node="gone", output="y", consumer_node="head", arg="x", worker_id="new")])
    assert outbox.targets == {("far", 9)}
    with control.cv:
        router.send_output("fwd", "y", 0, -1, [np.ones(1)])
    assert [h.to.worker_id for h in outbox.sent] == ["far"], "the refused rewire replaced some routes"


@pytest.mark.parametrize("stuck", ["output-log spill", "instance record"])
def test_a_file_write_that_hangs_leaves_the_job_lock_and_its_calls_free(
        stuck: str, workers: dict[str, Worker], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # Every value pushed across workers spills (a 1-byte log limit), or every instance
    # writes its record; the file system hangs in that write. Meanwhile the job's lock is
    # free and its worker answers RunSteps; once the write goes on, the run ends bitwise.
    entered, release = threading.Event(), threading.Event()
    if stuck == "output-log spill":
        real_save = np.save

        def stuck_save(*args: Any, **kwargs: Any) -> None:
            entered.set()
            assert release.wait(60)
            real_save(*args, **kwargs)

        monkeypatch.setattr(np, "save", stuck_save)
        request: dict[str, Any] = {"log_limit_bytes": 1}
    else:
        real_ran = InstanceRecords.ran

        def stuck_ran(self: InstanceRecords, *args: Any) -> None:
            entered.set()
            assert release.wait(60)
            real_ran(self, *args)

        monkeypatch.setattr(InstanceRecords, "ran", stuck_ran)
        request = {}
    _, ref = compiled_and_reference("pipeline_mlp")
    job = load("pipeline_mlp", workers, **request)
    try:
        job.grant(job.spec.steps)
        assert entered.wait(60), f"no {stuck} was written"
        for w in job.requests:
            rt = workers[w].service._jobs[job.spec.job]
            got = rt.control.cv.acquire(timeout=5)
            if got:
                rt.control.cv.release()
            assert got, f"the job's lock on {w} was held while a {stuck} hung"
            workers[w].stub.RunSteps(pb.RunStepsRequest(to=workers[w].to(), job=job.spec.job,
                                                        until_step=job.spec.steps), timeout=5)
    finally:
        release.set()
    job.wait_instances(job.spec.steps)
    assert state_digest(job.fetch_states()) == ref.state_digest
    job.unload()


class _Produce:
    """A node program that makes one 1 MiB value per instance (no device)."""

    def __call__(self, *args: Any) -> list[np.ndarray]:
        return [np.ones(VALUE_BYTES // 4, np.float32)]

    def first_report(self) -> None:
        return None


class _NoCheckpoints:
    def barrier(self, slice_name: str) -> float:
        return float("inf")

    def due(self, slice_name: str, low: int) -> None:
        return None

    def take_saving_s(self, slice_name: str) -> float:
        return 0.0


VALUE_BYTES = 1 << 20
LIMIT = 4 * VALUE_BYTES
STEPS = 48


def _producer(tmp_path: Path, server: DataPlaneServer, limit: int, steps: int,
              produce: Any) -> tuple[OutputLog, JobControl, Outbox, SliceScheduler, PeerChannels]:
    """A one-node slice ``s`` whose node ``prod`` pushes its output ``y`` to ``server`` through a real outbox
    (two push threads) and an output log of ``limit`` bytes spilling under ``tmp_path``; not started."""
    outlog = OutputLog(limit, spill_dir=tmp_path)
    control = JobControl("j", cluster="c", worker_id="here", admit=lambda to: None, incarnation=lambda: 1,
                         outlog=outlog)
    peers = PeerChannels()
    outbox = Outbox(control, outlog, peers, push_threads=2)
    prog = pb.NodeProgram(name="prod", slice="s", every=1, outputs=[pb.OutputSpec(name="y", leaves=1)])
    node = LoadedNode(prog, produce, (-1,), NodeProgress(1, (-1,), steps))  # type: ignore[arg-type]
    nodes = {"prod": node}
    inputs = Inputs(control, nodes, {}, steps=steps, microbatches=1)
    router = Router(control, nodes, set(), {}, inputs, outbox, steps=steps, start_step=0)
    router.set_routes([pb.Route(node="prod", output="y", consumer_node="cons", arg="x", worker_id="far",
                                incarnation=2, data_address=server.address)])
    records = InstanceRecords(None, worker="here", incarnation=1, slices=["s"], start_step=0, restored_from=None)
    scheduler = SliceScheduler(control, {"s": [node]}, inputs=inputs, router=router,
                               handoff=_NoCheckpoints(), records=records, states={},  # type: ignore[arg-type]
                               steps=steps, start_step=0)
    return outlog, control, outbox, scheduler, peers


def _stop(control: JobControl, outbox: Outbox, scheduler: SliceScheduler, server: DataPlaneServer,
          peers: PeerChannels, outlog: OutputLog) -> None:
    """Unload what :func:`_producer` made: the slice's thread, the pushes, the consumer, the log's files."""
    with control.cv:
        control.stopped = True
        control.cv.notify_all()
    outbox.shutdown()
    scheduler.join(5)
    server.stop()
    peers.close()
    outlog.close()


def test_pushes_to_a_consumer_that_stops_reading_hold_the_producer_back_within_the_log_limit(tmp_path: Path) -> None:
    # A producer pushes a 1 MiB value per step over a real data-plane connection to a
    # consumer that stops reading after its first value. The bytes of pushes not yet
    # ended never pass the log's limit by more than one value: the producer stops
    # instead, and the log itself spills past its limit. Once the consumer reads again,
    # the producer runs to the end and every value arrives.
    go_on = threading.Event()
    received: list[int] = []

    def consumer(header: pb.TransferHeader, leaves: list[np.ndarray]) -> tuple[Status, str]:
        go_on.wait(60)  # stops reading: its connections' buffers fill up
        received.append(int(header.step))
        return Status.DELIVERED, ""

    server = DataPlaneServer("127.0.0.1", consumer)
    server.start()
    outlog, control, outbox, scheduler, peers = _producer(tmp_path, server, LIMIT, STEPS, _Produce())
    peak = [0, 0]  # the most bytes in pushes not yet ended, and in the log's memory, seen

    def watch() -> int:
        with control.cv:
            peak[0] = max(peak[0], outbox._pools._pending * VALUE_BYTES)
            peak[1] = max(peak[1], outlog.memory_bytes)
            return scheduler.completed

    try:
        scheduler.start()
        with control.cv:
            control.until = STEPS
            control.cv.notify_all()
        last, since = -1, time.monotonic()
        while time.monotonic() - since < 1.0:  # until the producer made no progress for a second
            done = watch()
            if done >= STEPS:
                break
            if done != last:
                last, since = done, time.monotonic()
            time.sleep(0.01)
        stalled_at = watch()
        assert stalled_at < STEPS, "the producer ran every step while its consumer read nothing"
        assert peak[0] <= LIMIT + VALUE_BYTES, f"{peak[0]} bytes waited in pushes, over the {LIMIT} byte limit"
        go_on.set()
        # Every push ended too: the consumer counts a value before its push returns, and the
        # push's thread spills the log back within its limit only after that.
        wait_until(lambda: watch() >= STEPS and len(received) >= STEPS and outbox.backlog_bytes == 0, 60,
                   "the rest of the run")
        assert sorted(received) == list(range(STEPS))
        assert peak[0] <= LIMIT + VALUE_BYTES and outbox.peak_backlog_bytes <= LIMIT + VALUE_BYTES
        assert peak[1] <= LIMIT + VALUE_BYTES, f"the log held {peak[1]} bytes in memory"
        assert outlog.memory_bytes <= LIMIT and outlog.spilled_bytes == (STEPS * VALUE_BYTES - outlog.memory_bytes)
    finally:
        go_on.set()
        _stop(control, outbox, scheduler, server, peers, outlog)


class _ProduceSlowly(_Produce):
    """:class:`_Produce` taking 20 ms an instance: a push of its value ends well before the next one is made."""

    def __call__(self, *args: Any) -> list[np.ndarray]:
        time.sleep(0.02)
        return super().__call__(*args)


def test_in_the_steady_state_the_push_threads_spill_the_log_and_the_slice_thread_writes_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A producer slower than its pushes logs 1 MiB a step past a 16 MiB log limit: three quarters of its values
    # spill. The push threads spill below the limit, so the slice's own thread (which the next instance waits
    # for) finds room under it and writes (almost) no file.
    steps, limit = 32, 16 * VALUE_BYTES
    writers: list[str] = []
    real_save = np.save

    def counted_save(*args: Any, **kwargs: Any) -> None:
        writers.append(threading.current_thread().name)
        real_save(*args, **kwargs)

    monkeypatch.setattr(np, "save", counted_save)
    server = DataPlaneServer("127.0.0.1", lambda header, leaves: (Status.DELIVERED, ""))
    server.start()
    outlog, control, outbox, scheduler, peers = _producer(tmp_path, server, limit, steps, _ProduceSlowly())
    try:
        scheduler.start()
        with control.cv:
            control.until = steps
            control.cv.notify_all()
        wait_until(lambda: scheduler.completed >= steps and outbox.backlog_bytes == 0, 60, "the run")
        assert len(writers) >= steps - limit // VALUE_BYTES, writers  # the log did spill
        on_slice = [w for w in writers if w == "run-j-s"]
        assert len(on_slice) <= 2, f"the slice's thread spilled {len(on_slice)} of {len(writers)} values"
        assert outlog.peak_memory_bytes <= limit + VALUE_BYTES
    finally:
        _stop(control, outbox, scheduler, server, peers, outlog)
