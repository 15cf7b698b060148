"""A job whose own program fails on a worker: the worker says so, typed, and blames nothing of its own.

``program_fault`` tells the program's failures (out of device memory, a program XLA rejects,
a shape error, a program that does not deserialize) from the worker's (a device that stops
answering: XLA's INTERNAL or UNAVAILABLE; the host's I/O). ``LoadJob`` reports the first as
INTERNAL with a ``program_failed`` typed error naming the part and the error, and the worker
goes on serving: the next job loads.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import jax
import pytest

from rallypoint.client import Program
from rallypoint.client.compile import compile_program
from rallypoint.client.jobspec import job_spec
from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.recovery.decide import Verdict
from rallypoint.recovery.load_plan import SlicePlace, load_requests
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto.errors import ProgramFailure, parse_error
from rallypoint.workers.runtime.load import ProgramFailed, program_fault
from tests.helpers.runtime import TIB, Worker, started_workers, tiny

def request(prog: Program, worker: Worker) -> pb.LoadJobRequest:
    spec = job_spec(compile_program(prog))
    place = {"s": SlicePlace(worker.worker_id, worker.address, worker.incarnation, (0,))}
    return load_requests(spec, place, cluster="test", term=1)[worker.worker_id]


@pytest.fixture
def worker() -> Iterator[Worker]:
    with started_workers() as ws:
        yield ws["wA"]


def load_failure(worker: Worker, req: pb.LoadJobRequest) -> WorkerCallFailed:
    with pytest.raises(grpc.RpcError) as info:
        worker.stub.LoadJob(req, timeout=60)
    return WorkerCallFailed.from_rpc_error(worker.worker_id, "LoadJob", info.value)


def test_an_init_that_asks_for_a_tebibyte_is_reported_as_the_programs_failure_and_the_worker_serves_on(
        worker: Worker) -> None:
    f = load_failure(worker, request(tiny("huge", TIB), worker))
    assert f.code is grpc.StatusCode.INTERNAL and f.verdict is Verdict.PROGRAM, f
    assert f.program == ProgramFailure("state 'w' init", f.program.error if f.program else "")
    assert f.program is not None and "RESOURCE_EXHAUSTED" in f.program.error, f.program
    assert "state 'w' init failed on worker wA" in f.details and "1099511627776" in f.details
    assert worker.service.loaded("huge") is None  # nothing half-loaded is left
    resp = worker.stub.LoadJob(request(tiny("small", 4), worker), timeout=60)  # the worker is as healthy as before
    assert resp.load_s > 0 and worker.service.loaded("small") is not None


def test_a_node_whose_program_does_not_deserialize_is_the_programs_failure(worker: Worker) -> None:
    req = request(tiny("garbled", 4), worker)
    req.nodes[0].exported = b"\x00not an exported program"
    f = load_failure(worker, req)
    assert f.verdict is Verdict.PROGRAM and f.program is not None and f.program.part == "node 'add'", f


def _xla(code: str) -> Exception:
    return jax.errors.JaxRuntimeError(f"{code}: something happened")


@pytest.mark.parametrize(("exc", "programs"), [
    (_xla("RESOURCE_EXHAUSTED"), True),  # out of device memory
    (_xla("INVALID_ARGUMENT"), True),  # a program XLA rejects
    (_xla("UNIMPLEMENTED"), True),  # an op the backend cannot compile
    (_xla("OUT_OF_RANGE"), True),
    (ValueError("the exported function expects 4 devices, the mesh has 1"), True),  # a shape or mesh error
    (TypeError("unsupported operand"), True),  # an exception in the user's code as it is traced or run
    (_xla("INTERNAL: device lost"), False),  # the device's, not the program's
    (_xla("UNAVAILABLE"), False),
    (_xla("DEADLINE_EXCEEDED"), False),
    (OSError("No space left on device"), False),  # the host's
    (MemoryError(), False),
])
def test_program_fault_tells_the_programs_failures_from_the_workers(exc: BaseException, programs: bool) -> None:
    assert program_fault(exc) is programs


def test_program_failed_names_the_part_the_worker_and_the_error() -> None:
    e = ProgramFailed("state 'params' init", "w3", _xla("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes."))
    assert str(e).startswith("state 'params' init failed on worker w3: JaxRuntimeError: RESOURCE_EXHAUSTED")
    assert parse_error(()) is None
