"""A multi-host slice inside the runtime of its lead worker: values, programs and layouts on its group.

A slice whose ``SliceAssignment`` lists gang ``members`` runs on the JAX distributed group
of those workers (:mod:`rallypoint.workers.gang.group`, each member on its own worker via
:mod:`rallypoint.workers.gang.link`), driven by the first member's runtime, which keeps
the slice's schedule, inputs, outputs, states and checkpoints exactly as for a slice on
its own devices. Only where a value lives differs, and three small types carry it through
the runtime's existing paths (docs/multihost.md):

* :class:`GangSlice` stands where a slice's ``jax.sharding.Mesh`` does (``mesh_of``): the
  group, formed at load, with the slice's global mesh;
* :class:`GroupValue` stands where a ``jax.Array`` does (a state version, an output, an
  argument): the name of a global array on the members, each holding its shards.
  ``np.asarray`` of one gathers it here from the members' shards (a metric, a value for a
  consumer on this worker, the final state); a push to another worker goes shard by shard
  instead (:meth:`GangSlice.send`), as do checkpoints
  (:mod:`rallypoint.workers.gang.checkpoint`); a value no longer referenced is dropped on
  the members with the next request;
* :class:`GroupSharding` stands where a ``jax.sharding.Sharding`` does (a program's
  argument or output layout): :func:`rallypoint.workers.residency.place` hands a host
  value to it, and it is put on the members shard by shard, each member sent only its own.

:class:`GangExecutable` is the node program (``LoadedNode.call``): loaded on every member,
called with the slice's values, its outputs left on the members.

A member lost (its worker killed, hung or cut off) raises
:class:`~rallypoint.workers.gang.group.GroupLost` from whatever request was under way.
"""

from __future__ import annotations

import base64
import itertools
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.gang.group import SliceGroup

MESH = "m"  # the slice's global mesh on its members


class GangSlice:
    """One multi-host slice's group, with its global mesh; the runtime's ``mesh`` for the slice."""

    def __init__(self, name: str, group: SliceGroup, mesh_shape: Sequence[int], mesh_axes: Sequence[str],
                 members: Sequence[pb.GangMember] = ()) -> None:
        self.name, self.group = name, group
        self.members = list(members)  # the workers of its members, in process order
        self.shape, self.axes = tuple(mesh_shape), tuple(mesh_axes)
        group.mesh(MESH, list(mesh_shape), list(mesh_axes))
        self._names = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def form(cls, sa: pb.SliceAssignment, stub: Any, *, cluster: str, request_timeout_s: float = 120.0,
             job: str = "", cancel: threading.Event | None = None) -> GangSlice:
        """Form the group of ``sa.members`` (``stub(address, worker)``: a ``WorkerRuntimeStub`` whose server must be
        that worker)."""
        from rallypoint.workers.gang.link import form_on_workers

        per = {int(m.devices) for m in sa.members}
        if len(per) != 1:
            raise ValueError(f"slice {sa.slice!r}: its members give {sorted(per)} devices; a gang's must be equal")
        workers = [(stub(m.address, m.worker_id),
                    pb.Identity(cluster=cluster, worker_id=m.worker_id, incarnation=m.incarnation)) for m in sa.members]
        group = form_on_workers(workers, per.pop(), request_timeout_s=request_timeout_s,
                                device_ids=[list(m.device_ids) for m in sa.members], job=job, slice_name=sa.slice,
                                cancel=cancel)
        try:
            return cls(sa.slice, group, sa.mesh_shape, sa.mesh_axes, sa.members)
        except BaseException:
            group.abort()
            raise

    @property
    def size(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    def fresh(self) -> str:
        with self._lock:
            return f"v{next(self._names)}"

    def value(self, dtype: Any, shape: Sequence[int]) -> GroupValue:
        return GroupValue(self, self.fresh(), np.dtype(dtype), tuple(shape))

    def put(self, array: Any, layout: dict[str, Any]) -> GroupValue:
        a = np.asarray(array)
        v = self.value(a.dtype, a.shape)
        self.group.put_as(v.name, a, layout)
        return v

    def send(self, values: Sequence[GroupValue], address: str, header: pb.TransferHeader) -> bool:
        """Send one value (``values``: its leaves, on this group) to the data plane at ``address``, shard by
        shard: each member sends the shards it holds the first replica of, from its own host, and the receiver
        puts the pieces together (:mod:`rallypoint.workers.gang.pieces`). Whether the receiver had it already.

        Raises:
            DataPlaneError: a member's frame was refused, or its connection failed (the first such member's).
            GroupLost: a member was lost meanwhile.
        """
        from rallypoint.workers.dataplane import DataPlaneError, Status

        h = pb.TransferHeader()
        h.CopyFrom(header)
        h.value_leaves = len(values)
        answers = self.group.request({"op": "send", "transfer": base64.b64encode(h.SerializeToString()).decode(),
                                      "address": address, "values": [v.name for v in values]})
        for j, (a, _) in enumerate(answers):
            if "failed" in a:
                raise DataPlaneError(Status[a["status"]] if a.get("status") else None, f"member {j}: {a['failed']}")
        return any(bool(a.get("duplicate")) for a, _ in answers)

    def fetch(self, v: GroupValue) -> np.ndarray:
        return self.group.fetch(v.name)

    def close(self) -> None:
        self.group.close()

    def abort(self) -> None:
        self.group.abort()


def on_gang(value: Any) -> GangSlice | None:
    """The group whose members hold ``value`` (a :class:`~rallypoint.workers.residency.HostCopy` not yet copied to
    this host, every leaf a :class:`GroupValue` of one gang), or None."""
    if getattr(value, "ready", True):
        return None
    leaves = value.leaves()
    if not leaves or not all(isinstance(v, GroupValue) for v in leaves):
        return None
    gangs = {id(v.gang): v.gang for v in leaves}
    return next(iter(gangs.values())) if len(gangs) == 1 else None


class GroupValue:
    """One leaf of a value on a multi-host slice: a global array held, shard by shard, by its members."""

    __slots__ = ("gang", "name", "dtype", "shape", "host", "__weakref__")

    def __init__(self, gang: GangSlice, name: str, dtype: np.dtype, shape: tuple[int, ...],
                 host: np.ndarray | None = None) -> None:
        self.gang, self.name, self.dtype, self.shape = gang, name, dtype, shape
        self.host = host  # its value, when the call that made it sent it back (a scalar: a metric, say)
        weakref.finalize(self, gang.group.release, name)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.host if self.host is not None else self.gang.fetch(self)
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"GroupValue({self.gang.name}:{self.name}, {self.dtype}{list(self.shape)})"


class GroupSharding:
    """A layout on a multi-host slice: as one of its programs takes an argument (or gives an output).

    ``whole`` False: one microbatch's part of a gathered argument, kept on the host until the
    step's parts are stacked (:func:`rallypoint.workers.runtime.inputs._stack`) and put whole."""

    def __init__(self, gang: GangSlice, layout: dict[str, Any], *, whole: bool = True) -> None:
        self.gang, self.layout, self.whole = gang, layout, whole

    def unstacked(self) -> GroupSharding:
        return GroupSharding(self.gang, self.layout, whole=False)

    def place_leaf(self, x: Any, copies: Any, purpose: str, small: str) -> Any:
        """``x`` on the slice's members laid out so: a host value is put there (counted as ``purpose``),
        unless it is a gathered part, or a small one (``small``, as :func:`~rallypoint.workers.residency.place`
        says): a value received here stays on the host until its instance, an instance's argument travels in
        its call (:class:`GangExecutable`)."""
        from rallypoint.workers.residency import SMALL_VALUE_BYTES

        if isinstance(x, GroupValue):
            return x
        a = np.asarray(x)
        if not self.whole or (small and a.nbytes < SMALL_VALUE_BYTES):
            if small == "call" and copies is not None:
                copies.add("h2d", purpose, int(a.nbytes))
            return x
        v = self.gang.put(a, self.layout)
        if copies is not None:
            copies.add("h2d", purpose, int(a.nbytes))
        return v


class GangExecutable:
    """A node's (or a state init's) exported program on every member of a multi-host slice."""

    _ids = itertools.count()

    def __init__(self, blob: bytes, gang: GangSlice) -> None:
        self.gang = gang
        self.prog = f"p{next(self._ids)}"
        ins, outs = gang.group.load(self.prog, blob, MESH)
        self.in_shardings = tuple(GroupSharding(gang, {"prog": self.prog, "arg": i}) for i in range(ins))
        self.out_shardings = tuple(GroupSharding(gang, {"prog": self.prog, "out": i}) for i in range(outs))
        self.source, self.compile_s = "", 0.0
        self._reported = False

    @property
    def mesh(self) -> GangSlice:
        return self.gang

    @property
    def expected(self) -> str:
        return "cold"  # no warm spare compiles a multi-host slice's programs ahead

    def __call__(self, *args: Any) -> list[GroupValue]:
        """One request to the members: the small host arguments (the step, a small value received here) travel in
        it, and the scalar outputs (the metrics) come back in its answer; a larger host argument goes on first."""
        t0 = time.perf_counter()
        placed: list[GroupValue | None] = []  # held until the call is sent: a value let go of is freed with it
        host: dict[int, np.ndarray] = {}
        for i, (a, s) in enumerate(zip(args, self.in_shardings, strict=True)):
            v = s.place_leaf(a, None, "transfer", "call")  # a small host value is left here: it goes in the call
            if isinstance(v, GroupValue):
                placed.append(v)
            else:
                host[i] = np.asarray(v)
                placed.append(None)
        outs = [self.gang.fresh() for _ in self.out_shardings]
        avals, scalars = self.gang.group.call(self.prog, [v.name if v is not None else None for v in placed], outs,
                                              host=host)
        del placed
        result = [GroupValue(self.gang, name, np.dtype(d), shape, scalars.get(i))
                  for i, (name, (d, shape)) in enumerate(zip(outs, avals, strict=True))]
        if not self.source:
            self.source, self.compile_s = "compiled", time.perf_counter() - t0
        return result

    def first_report(self) -> tuple[str, float] | None:
        if self._reported or not self.source:
            return None
        self._reported = True
        return self.source, self.compile_s
