"""Receiving peers for the transfer benchmark, each in its own process.

``measure_dataplane`` drives the workers' tensor data plane
(:mod:`rallypoint.workers.dataplane`: the receiver allocates each array and ``recv_into`` it);
``measure_grpc_push`` the gRPC ``Push`` fallback (:func:`rallypoint.proto.codec.chunks` /
:func:`rallypoint.proto.codec.assemble`). Both send ``count`` values of ``value_mb`` MiB.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRPC_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def _serve_grpc(port_q: Any, stop: Any) -> None:
    import grpc

    from rallypoint.proto import codec
    from rallypoint.proto import rallypoint_pb2 as pb
    from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc

    class Receiver(pb_grpc.WorkerRuntimeServicer):
        def Push(self, request_iterator, context):  # type: ignore[no-untyped-def]
            codec.assemble(request_iterator)
            return pb.PushResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    pb_grpc.add_WorkerRuntimeServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_q.put(f"127.0.0.1:{port}")
    stop.wait()
    server.stop(0)


def _serve_dataplane(port_q: Any, stop: Any) -> None:
    from rallypoint.workers.dataplane import DataPlaneServer, Status

    server = DataPlaneServer("127.0.0.1", lambda header, leaves: (Status.DELIVERED, ""))
    server.start()
    port_q.put(server.address)
    stop.wait()
    server.stop()


def _measure(serve: Callable[[Any, Any], None], send: Callable[[str, list[Any]], None], value_mb: int,
             count: int) -> float:
    import numpy as np

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve, args=(q, stop))
    proc.start()
    try:
        address = q.get(timeout=60)
        leaf = np.ones((value_mb << 20) // 4, np.float32)
        send(address, [leaf[:1024]])  # connect, warm up
        t = time.perf_counter()
        for _ in range(count):
            send(address, [leaf])
        return value_mb * count / (time.perf_counter() - t)
    finally:
        stop.set()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def measure_dataplane(value_mb: int, count: int) -> float:
    """MB/s of ``count`` values of ``value_mb`` MiB over the data plane to a peer process."""
    from rallypoint.proto import rallypoint_pb2 as pb
    from rallypoint.workers.dataplane import DataPlaneClient

    client = DataPlaneClient()
    try:
        return _measure(_serve_dataplane, lambda a, v: client.send(a, pb.TransferHeader(job="b"), v), value_mb, count)
    finally:
        client.close()


def measure_grpc_push(value_mb: int, count: int) -> float:
    """MB/s of the same values as gRPC ``Push`` streams."""
    import grpc

    from rallypoint.proto import codec
    from rallypoint.proto import rallypoint_pb2 as pb
    from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc

    channels: dict[str, Any] = {}

    def send(address: str, leaves: list[Any]) -> None:
        if address not in channels:
            channels[address] = pb_grpc.WorkerRuntimeStub(grpc.insecure_channel(address, options=GRPC_OPTIONS))
        channels[address].Push(codec.chunks(pb.TransferHeader(job="b"), leaves), timeout=300)

    return _measure(_serve_grpc, send, value_mb, count)
