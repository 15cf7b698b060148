"""One member process of a multi-host slice's JAX distributed group (docs/multihost.md).

A slice larger than one worker runs multi-controller: one process per member worker,
joined by ``jax.distributed`` into one set of global devices, each running the same
programs on its addressable shards. JAX's coordination service aborts every member when
one dies (SIGABRT after the heartbeat timeout), so a member cannot be the long-lived
worker daemon: the daemon starts this process and supervises it
(:class:`rallypoint.workers.gang.group.MemberProcess`), and the group is lost and formed
anew as a unit.

Started as ``python -m rallypoint.workers.gang.member`` with the group's settings as
JSON in ``argv[1]`` (``coordinator``, ``processes``, ``process``, ``local_devices``,
``platform``, ``init_timeout_s``, ``heartbeat_s``, ``address``: its own host's address, where
its gloo transport listens, ``device_ids``, and from its daemon ``tls`` and ``compile_cache``:
its worker's TLS paths and compilation cache), or ahead of need as ``... --pooled`` (a worker's
member pool, :class:`rallypoint.workers.gang.link.MemberPool`): it then imports JAX and
Orbax at once and reads the settings as its first frame, ``{"settings": {...}}``, when a slice
needs it. It joins the group, answers
``{"ready": ...}`` and then serves requests on stdin, one at a time, in order: a JSON
header line, then the payloads whose byte sizes the header lists in ``sizes``; each
answer has the same form, or ``{"error": ...}`` for a request it refuses (a bad program,
a shard that does not fit): a user error, the group stays. Nothing is pickled.

Requests (``op``):

* ``mesh`` ``{name, shape, axes}``: a mesh over the global devices in process order.
* ``load`` ``{prog, mesh}`` + the exported program's bytes (``jax.export``).
* ``where`` ``{mesh, spec, shape}``: the indices of the shards this process holds.
* ``put`` ``{value, mesh, spec, shape, dtype, shards}`` + one payload per shard: a global
  array made of this process's shards only.
* ``call`` ``{prog, args, outs}``: run a loaded program; the outputs stay here.
* ``get`` ``{value}``: this process's shards (each index once) and their bytes.
* ``save`` ``{dir, tree, wait}``: an Orbax multi-process checkpoint of ``{state: [leaf values]}``
  (each process writes its own shards; process 0 finalizes). ``wait`` false answers once Orbax
  holds its host copy and goes on writing in the background; ``saved`` ``{dir, wait}`` waits for
  it (``wait`` false: answers at once whether it is ``done``), as the next save, a restore and
  ``exit`` do.
* ``restore`` ``{dir, tree}``: the same tree read back, each leaf ``{value, shape, dtype}`` and
  its layout (as ``put``'s), each process reading its own shards. ``save`` and ``restore`` answer
  ``shards``: ``[state, leaf, index, dtype, shape, sha256]`` of every shard this process holds
  the first replica of (together the members' cover each leaf once).
* ``send`` ``{transfer, address, values}``: the shards of the value ``values`` (its leaves) this
  process holds the first replica of, sent from here to the data plane at ``address`` as one
  frame of pieces under the base64 ``TransferHeader`` given (workers/gang/pieces.py); answers
  ``pieces`` and ``duplicate``, or ``failed`` with the refusal's ``status``.
* ``save`` with ``keep``, ``stash``, ``pushed``, ``restore_parts``: the in-memory tier's copies of
  this process's shards (workers/gang/member_parts.py, workers/gang/replicas.py).
* ``free`` ``{values}``; ``exit`` (after the saves still writing and the copies still being pushed).

The user's prints and JAX's logs go to stderr, never into the protocol; the process
ends when stdin closes and with its daemon (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any, BinaryIO

from rallypoint.workers.gang.member_bounds import check_request, host_arguments

Index = list[list[int | None]]


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the closed stdin still ends it


MAX_HEADER = 16 << 20  # bytes of one header line: a stream that sends more without a newline is not a member's
MAX_PAYLOADS = 1 << 16  # payloads of one frame
MAX_FRAME_BYTES = 1 << 36  # bytes of one frame's payloads together (64 GiB, the data plane's limit on a value)


def frame_header(line: bytes | bytearray) -> tuple[dict[str, Any], list[int]]:
    """A frame's header line as ``(header, payload sizes)``, checked before any payload is read.

    Raises:
        ValueError: not a JSON object, ``sizes`` not a list of at most ``MAX_PAYLOADS`` non-negative integers
            adding up to at most ``MAX_FRAME_BYTES``.
    """
    try:
        header = json.loads(line)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"a frame's header is not JSON ({type(exc).__name__}): the stream is not a member's") from None
    if not isinstance(header, dict):
        raise ValueError(f"a frame's header is a JSON {type(header).__name__}, not an object")
    sizes = header.get("sizes", [])
    if not isinstance(sizes, list) or len(sizes) > MAX_PAYLOADS or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes):
        raise ValueError(f"a frame's sizes are not a list of at most {MAX_PAYLOADS} byte counts")
    if sum(sizes) > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {sum(sizes)} bytes is over the limit of {MAX_FRAME_BYTES}")
    return header, sizes


def read_frame(stream: BinaryIO) -> tuple[dict[str, Any], list[bytes]] | None:
    """One header line and its payloads, or None at the end of the stream.

    Raises:
        ValueError: the header line runs past ``MAX_HEADER`` bytes, or is refused by :func:`frame_header`.
    """
    line = stream.readline(MAX_HEADER + 1)
    if not line:
        return None
    if len(line) > MAX_HEADER:
        raise ValueError(f"a frame's header line runs past {MAX_HEADER} bytes: the stream is not a member's")
    header, sizes = frame_header(line)
    payloads = []
    for n in sizes:
        data = _read_exact(stream, n)
        if data is None:
            return None
        payloads.append(data)
    return header, payloads


def _read_exact(stream: BinaryIO, n: int, step: int = 1 << 20) -> bytes | None:
    """``n`` bytes of ``stream`` (None: it ended first), read a bounded step at a time: a frame's claimed size
    never makes a buffer bigger than the bytes that arrived (a buffered ``read(n)`` allocates ``n`` at once)."""
    if n <= step:
        data = stream.read(n)
        return data if len(data) == n else None
    parts, got = [], 0
    while got < n:
        part = stream.read(min(step, n - got))
        if not part:
            return None
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def encode_frame(header: dict[str, Any], payloads: Sequence[Any] = ()) -> list[Any]:
    """A frame's parts in order: the header line (with the payloads' ``sizes``), then each payload's bytes."""
    views = [memoryview(p).cast("B") for p in payloads]
    return [(json.dumps(dict(header, sizes=[v.nbytes for v in views])) + "\n").encode(), *views]


def write_frame(stream: BinaryIO, header: dict[str, Any], payloads: Sequence[Any] = ()) -> None:
    stream.writelines(encode_frame(header, payloads))
    stream.flush()


def index_of(slices: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    """A shard's index as ``[[start, stop], ...]`` per axis (JSON), full axes spelled out."""
    out = []
    for s, n in zip(slices, shape, strict=False):
        start, stop, _ = s.indices(n)
        out.append([start, stop])
    return out + [[0, n] for n in shape[len(out):]]


def _gloo_on(address: str) -> None:
    """Make gloo listen on, and tell its peers, this member's own address.

    JAX makes gloo's TCP transport without a hostname, so gloo takes the address the host
    name resolves to: 127.0.0.1 here (``/etc/hosts``), 127.0.1.1 on a stock Debian host,
    useless to the other members either way. The transport accepts a hostname; JAX does not
    pass one, so the one call is wrapped before the backend starts."""
    import functools

    from jax._src import xla_bridge

    make = xla_bridge._jax.make_gloo_tcp_collectives
    if not isinstance(make, functools.partial):
        xla_bridge._jax.make_gloo_tcp_collectives = functools.partial(make, hostname=address)


class Member:
    """The JAX side of one member: meshes, programs and values by name."""

    def __init__(self, settings: dict[str, Any]) -> None:
        platform = str(settings.get("platform") or "cpu")
        local = int(settings["local_devices"])
        os.environ["JAX_PLATFORMS"] = platform
        if platform == "cpu":  # the worker's own count (its daemon's environment) is not the member's
            flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count")]
            os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={local}"])
        import jax

        if settings.get("compile_cache"):  # before anything compiles: its worker's cache, shared with other members
            from rallypoint.workers.programs import configure_compile_cache

            configure_compile_cache(str(settings["compile_cache"]))
        jax.config.update("jax_platforms", platform)  # read from the environment when JAX was imported: a pooled
        # member imported it before it knew its platform (XLA reads its flags later, when the backend starts)
        if platform == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            if settings.get("address"):
                _gloo_on(str(settings["address"]))
        t0 = time.monotonic()
        ids = [int(i) for i in settings.get("device_ids") or ()]
        jax.distributed.initialize(
            coordinator_address=str(settings["coordinator"]), num_processes=int(settings["processes"]),
            process_id=int(settings["process"]), initialization_timeout=int(settings.get("init_timeout_s", 60)),
            heartbeat_timeout_seconds=int(settings.get("heartbeat_s", 10)),
            # an accelerator's member uses only the devices its worker leased for the slice (on CPU the count
            # above makes the member's devices; there are no others to keep clear of)
            **({"local_device_ids": ids} if ids and platform != "cpu" else {}))
        self.init_s = time.monotonic() - t0
        self.jax = jax
        self.meshes: dict[str, Any] = {}
        self.programs: dict[str, Any] = {}
        self.layouts: dict[str, tuple[list[Any], list[Any]]] = {}  # program -> its (in, out) shardings
        self.values: dict[str, Any] = {}
        self.saving: dict[str, Any] = {}  # directory -> its save still writing (``save`` with ``wait`` false)
        from rallypoint.workers.gang.member_parts import Parts

        self.parts = Parts(settings.get("tls") or (), index_of)  # copies of its shards (workers/gang/replicas.py)
        self.job, self.dirs = str(settings.get("job") or ""), [str(d) for d in settings.get("dirs") or ()]

    def _finish_saves(self, directory: str | None = None) -> None:
        """Wait for the saves still writing (all of them, or the one into ``directory``: a KeyError if none)."""
        for d in [directory] if directory is not None else list(self.saving):
            ck, waiter = self.saving.pop(d)
            waiter.join()
            try:
                ck.wait_until_finished()  # done by now: raises what the writing raised
            finally:
                ck.close()

    def ready(self) -> dict[str, Any]:
        jax = self.jax
        return {"ready": True, "process": jax.process_index(), "processes": jax.process_count(),
                "devices": jax.device_count(), "local": [d.id for d in jax.local_devices()],
                "init_s": round(self.init_s, 4)}

    def _sharding(self, mesh: str, spec: list[Any]) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec

        parts = [tuple(p) if isinstance(p, list) else p for p in spec]
        return NamedSharding(self.meshes[mesh], PartitionSpec(*parts))

    def _layout(self, header: dict[str, Any]) -> Any:
        """Where a value goes: as a loaded program takes argument ``arg`` (or gives ``out``), or a mesh and spec."""
        if "prog" in header:
            ins, outs = self.layouts[header["prog"]]
            return ins[int(header["arg"])] if "arg" in header else outs[int(header["out"])]
        return self._sharding(header["mesh"], header["spec"])

    def serve(self, header: dict[str, Any], payloads: list[bytes]) -> tuple[dict[str, Any], list[Any]]:
        import numpy as np

        op = header["op"]
        check_request(header, job=self.job, dirs=self.dirs)  # its job's folder, values and copies only
        for name in header.get("free", ()):  # values the driver let go of since its last request
            self.values.pop(name, None)
        if op == "mesh":
            devices = sorted(self.jax.devices(), key=lambda d: (d.process_index, d.id))
            n = int(np.prod(header["shape"])) if header["shape"] else 1
            if n != len(devices):
                raise ValueError(f"a mesh of shape {tuple(header['shape'])} needs {n} devices; the group has "
                                 f"{len(devices)}")
            self.meshes[header["name"]] = self.jax.sharding.Mesh(
                np.array(devices).reshape(tuple(header["shape"])), tuple(header["axes"]))
            return {}, []
        if op == "load":
            from rallypoint.workers.programs import check_exported_platform
            from rallypoint.workers.warm import arg_shardings

            mesh = self.meshes[header["mesh"]]
            exp = self.jax.export.deserialize(bytearray(payloads[0]))
            check_exported_platform(exp, mesh)
            ins = arg_shardings(exp.in_shardings_jax(mesh), mesh)
            outs = arg_shardings(exp.out_shardings_jax(mesh), mesh)
            self.programs[header["prog"]] = self.jax.jit(exp.call, in_shardings=tuple(ins), out_shardings=tuple(outs))
            self.layouts[header["prog"]] = (ins, outs)
            return {"ins": len(ins), "outs": len(outs)}, []
        if op == "where":
            shape = tuple(header["shape"])
            found = self._layout(header).addressable_devices_indices_map(shape)
            return {"shards": _unique(index_of(s, shape) for s in found.values())}, []
        if op == "put":
            shape, dtype = tuple(header["shape"]), np.dtype(header["dtype"])
            given = {json.dumps(ix): np.frombuffer(p, dtype=dtype).reshape([b - a for a, b in ix])
                     for ix, p in zip(header["shards"], payloads, strict=True)}
            sharding = self._layout(header)

            def shard(slices: tuple[slice, ...]) -> Any:
                key = json.dumps(index_of(slices, shape))
                if key not in given:
                    raise ValueError(f"value {header['value']!r}: no shard {key} was given to process "
                                     f"{self.jax.process_index()}")
                return given[key]

            self.values[header["value"]] = self.jax.make_array_from_callback(shape, sharding, shard)
            return {"bytes": sum(p.nbytes if hasattr(p, "nbytes") else len(p) for p in payloads)}, []
        if op == "call":
            ins, _ = self.layouts[header["prog"]]  # an argument laid out otherwise is moved first
            host = host_arguments(header.get("host", ()), payloads, len(ins))  # small ones sent in the request
            args = [self.jax.make_array_from_callback(host[i].shape, s, lambda ix, h=host[i]: np.asarray(h[ix]))
                    if i in host else self.jax.device_put(self.values[a], s)
                    for i, (a, s) in enumerate(zip(header["args"], ins, strict=True))]
            outs = self.programs[header["prog"]](*args)
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            if len(outs) != len(header["outs"]):
                raise ValueError(f"program {header['prog']!r} returned {len(outs)} values, "
                                 f"{len(header['outs'])} were named")
            for name, v in zip(header["outs"], outs, strict=True):
                self.values[name] = v
            # Scalars come back with the answer (the metrics): every member holds the whole of one.
            scalars = [i for i, v in enumerate(outs) if header.get("scalars") and v.ndim == 0]
            return ({"avals": [[str(v.dtype), list(v.shape)] for v in outs], "scalars": scalars},
                    [np.asarray(outs[i].addressable_shards[0].data).reshape(-1).view(np.uint8) for i in scalars])
        if op == "get":
            v = self.values[header["value"]]
            seen: dict[str, Any] = {}
            for s in v.addressable_shards:
                seen.setdefault(json.dumps(index_of(s.index, v.shape)), s.data)
            arrays = [np.asarray(d).copy(order="C") for d in seen.values()]
            return {"dtype": str(v.dtype), "shape": list(v.shape),
                    "shards": [json.loads(k) for k in seen]}, [a.reshape(-1).view(np.uint8) for a in arrays]
        if op == "save":
            import orbax.checkpoint as ocp

            self._finish_saves()  # Orbax keys its barriers by a per-process operation id: one save at a time
            tree = {state: [self.values[n] for n in names] for state, names in header["tree"].items()}
            if header.get("keep"):  # the in-memory tier pushes a copy of its shards once the save commits
                self.parts.keep(header["dir"], tree)
            ck = ocp.StandardCheckpointer()
            ck.save(header["dir"], tree)  # returns once Orbax holds its host copy; it writes in the background
            if header.get("wait", True):
                ck.wait_until_finished()
                ck.close()
            else:  # a thread waits for the writing, so that ``saved`` can ask without waiting
                waiter = threading.Thread(target=ck.wait_until_finished, daemon=True, name="save-wait")
                waiter.start()
                self.saving[header["dir"]] = (ck, waiter)
            return {"shards": _digests(tree)}, []
        if op == "saved":
            if header["dir"] not in self.saving:  # written, and collected by an earlier ask
                return {"done": True}, []
            _, waiter = self.saving[header["dir"]]
            if header.get("wait", True) or not waiter.is_alive():
                self._finish_saves(header["dir"])
                return {"done": True}, []
            return {"done": False}, []
        if op == "restore":
            import orbax.checkpoint as ocp

            self._finish_saves()
            target = {state: [self.jax.ShapeDtypeStruct(tuple(leaf["shape"]), np.dtype(leaf["dtype"]),
                                                        sharding=self._layout(leaf)) for leaf in leaves]
                      for state, leaves in header["tree"].items()}
            with ocp.StandardCheckpointer() as ck:
                tree = ck.restore(header["dir"], target)
            for state, leaves in header["tree"].items():
                for leaf, v in zip(leaves, tree[state], strict=True):
                    self.values[leaf["value"]] = v
            return {"shards": _digests(tree)}, []
        if op == "send":
            return self._send(header), []
        if op == "stash":
            return self.parts.stash(header), []
        if op == "pushed":  # a drain: the copies under way arrive before the group ends
            return {"done": self.parts.finish(float(header.get("wait_s", 10.0)))}, []
        if op == "restore_parts":
            return self._restore_parts(header), []
        if op == "free":
            for n in header["values"]:
                self.values.pop(n, None)
            return {}, []
        raise ValueError(f"unknown request {op!r}")


    def _send(self, header: dict[str, Any]) -> dict[str, Any]:
        """Send the shards of ``header["values"]`` this process holds the first replica of to the data plane at
        ``header["address"]``, as pieces of one value (workers/gang/pieces.py): no process gathers the whole value."""
        import base64

        import numpy as np

        from rallypoint.proto import rallypoint_pb2 as pb
        from rallypoint.workers.dataplane import DataPlaneError

        t = pb.TransferHeader.FromString(base64.b64decode(header["transfer"]))
        arrays = []
        for leaf, name in enumerate(header["values"]):
            v = self.values[name]
            for s in v.addressable_shards:
                if s.replica_id == 0:
                    t.pieces.append(pb.Piece(leaf=leaf, start=[a for a, _ in index_of(s.index, v.shape)],
                                             shape=list(v.shape)))
                    arrays.append(np.ascontiguousarray(np.asarray(s.data)))
        if not arrays:  # every shard it holds is another member's first replica
            return {"pieces": 0}
        try:
            duplicate = self.parts.data().send(str(header["address"]), t, arrays)
        except DataPlaneError as exc:
            return {"failed": str(exc), "status": exc.status.name if exc.status is not None else None}
        nbytes = sum(int(a.nbytes) for a in arrays)
        self.parts.log.info("value.sent", member=self.jax.process_index(), to=t.to.worker_id, node=t.node,
                            output=t.output, step=t.step, microbatch=t.microbatch, pieces=len(arrays), bytes=nbytes)
        return {"pieces": len(arrays), "duplicate": duplicate, "bytes": nbytes}

    def _restore_parts(self, header: dict[str, Any]) -> dict[str, Any]:
        """Build the values of ``header["tree"]`` from a copy of this member's part (workers/gang/replicas.py)."""
        from rallypoint.workers.gang.member_parts import shard_key

        self._finish_saves()
        leaves = [(state, i, leaf, tuple(leaf["shape"]), self._layout(leaf))
                  for state, ls in header["tree"].items() for i, leaf in enumerate(ls)]
        need = _unique(shard_key(state, i, index_of(ix, shape)) for state, i, _, shape, sharding in leaves
                       for ix in sharding.addressable_devices_indices_map(shape).values())
        shards, holder, why = self.parts.fetch(header, need)
        if shards is None:
            return {"ok": False, "why": why}
        for state, i, leaf, shape, sharding in leaves:
            def shard(slices: tuple[slice, ...], state: str = state, i: int = i, shape: tuple[int, ...] = shape) -> Any:
                return shards[shard_key(state, i, index_of(slices, shape))]

            self.values[leaf["value"]] = self.jax.make_array_from_callback(shape, sharding, shard)
        return {"ok": True, "holder": holder, "bytes": sum(int(shards[k].nbytes) for k in need)}


def _digests(tree: dict[str, list[Any]]) -> list[list[Any]]:
    """``[state, leaf, index, dtype, shape, sha256]`` of each shard of ``tree`` this process holds the first
    replica of: the members' lists together cover every leaf exactly once (``checkpoint.shards_checksum``)."""
    import hashlib

    import numpy as np

    out = []
    for state, leaves in tree.items():
        for i, v in enumerate(leaves):
            for s in v.addressable_shards:
                if s.replica_id == 0:
                    data = np.ascontiguousarray(np.asarray(s.data))
                    out.append([state, i, index_of(s.index, v.shape), str(v.dtype), list(v.shape),
                                hashlib.sha256(data.reshape(-1).view(np.uint8).data).hexdigest()])
    return out


def _unique(indices: Any) -> list[Index]:
    out: list[Index] = []
    for ix in indices:
        if ix not in out:
            out.append(ix)
    return out


def main(argv: list[str]) -> int:
    _die_with_parent()
    out = os.fdopen(os.dup(1), "wb")  # the protocol; fd 1 itself now goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if argv == ["--pooled"]:  # started ahead: the imports now (most of a member's start), the settings when needed
        import jax  # noqa: F401
        import orbax.checkpoint  # noqa: F401

        first = read_frame(sys.stdin.buffer)
        if first is None or not isinstance(first[0].get("settings"), dict):
            return 0  # the pool closed it unused
        settings = first[0]["settings"]
    else:
        settings = json.loads(argv[0])
    try:
        member = Member(settings)
    except BaseException:  # noqa: BLE001 - reported to the daemon, which fails the formation
        write_frame(out, {"ready": False, "error": traceback.format_exc()})
        return 1
    write_frame(out, member.ready())
    stdin = sys.stdin.buffer
    while (frame := read_frame(stdin)) is not None:
        header, payloads = frame
        if header.get("op") == "exit":
            try:
                member._finish_saves()  # a save still writing is finished, not cut short
                member.parts.finish()  # and so are the copies of its shards still being pushed
            finally:
                write_frame(out, {})
            break
        try:
            answer, data = member.serve(header, payloads)
        except Exception as exc:  # noqa: BLE001 - a refused request, the group stays
            write_frame(out, {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
            continue
        write_frame(out, answer, data)
    out.close()
    member.jax.distributed.shutdown()  # a barrier: the group's driver asks every member to exit together
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
