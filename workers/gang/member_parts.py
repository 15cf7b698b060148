"""A gang member's side of the in-memory tier for multi-host slices (:mod:`rallypoint.workers.gang.replicas`).

:class:`Parts` runs in the member process (:mod:`rallypoint.workers.gang.member`): it keeps a
host copy of the shards the member holds at a save, pushes it to its holders once the step
commits (``PushReplica``, with its worker's TLS identity), and fetches its part back for a new
gang, checking each shard against the commit's listing (:func:`check_part`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from rallypoint.basics.logs import get_logger
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.checkpoints.checksums import digest

KEPT = 2  # saves whose host copies a member keeps until their commit asks for them
PUSH_TIMEOUT_S = 30.0
FINISH_S = 10.0  # how long a member leaving its group waits for its pushes still under way


def shard_key(state: str, leaf: int, index: Sequence[Sequence[int]]) -> str:
    return json.dumps([str(state), int(leaf), [[int(a), int(b)] for a, b in index]])


def check_part(shards: Mapping[str, np.ndarray], need: Iterable[str], listing: Sequence[Mapping[str, Any]]) -> str:
    """Why ``shards`` (key -> array) are not the commit's shards ``need`` as ``listing`` gives them ("": they are)."""
    entries = {shard_key(e["state"], e["leaf"], e["index"]): e for e in listing}
    for key in need:
        e = entries.get(key)
        if e is None:
            return f"the commit's listing has no shard {key}"
        a = shards.get(key)
        if a is None:
            return f"the copy lacks shard {key}"
        shape = [b - a for a, b in e["index"]]
        if a.dtype.name != e["dtype"] or list(a.shape) != shape:
            return f"shard {key} is {a.dtype.name}{list(a.shape)}, the commit's is {e['dtype']}{shape}"
        if digest(a) != e["sha256"]:
            return f"shard {key}'s bytes are not the ones committed"
    return ""


def _peer(p: Mapping[str, Any]) -> pb.ReplicaPeer:
    return pb.ReplicaPeer(slice=str(p.get("slice", "")), worker_id=str(p["worker_id"]), address=str(p["address"]),
                          incarnation=int(p["incarnation"]))


def peer_json(p: pb.ReplicaPeer) -> dict[str, Any]:
    return {"slice": p.slice, "worker_id": p.worker_id, "address": p.address, "incarnation": int(p.incarnation)}


class Parts:
    """A member process's side of the tier (its kept shards, their pushes, the fetch of its part) and its
    connections to other workers (those pushes, and its outputs' pieces: :mod:`rallypoint.workers.gang.pieces`).

    ``tls``: the CA, certificate and key paths of its worker (its daemon fills them in), or empty: plain TCP."""

    def __init__(self, tls: Sequence[str], index_of: Any) -> None:
        self._tls = tuple(tls)
        self._index_of = index_of
        self._peers: Any = None
        self._data: Any = None
        self.kept: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
        self._pushing: list[threading.Thread] = []
        self.log = get_logger("rallypoint.member")

    def _tls_config(self) -> Any:
        from rallypoint.basics.tls import TlsConfig

        return TlsConfig(*map(Path, self._tls)) if self._tls else None

    def peers(self) -> Any:
        if self._peers is None:
            from rallypoint.workers.transfer import PeerChannels

            self._peers = PeerChannels(self._tls_config())
        return self._peers

    def data(self) -> Any:
        """This member's data-plane connections, with its worker's TLS identity: a multi-host slice's outputs go
        to their consumers from each member's own host (:mod:`rallypoint.workers.gang.pieces`)."""
        if self._data is None:
            from rallypoint.workers.dataplane import DataPlaneClient

            self._data = DataPlaneClient(tls=self._tls_config())
        return self._data

    def keep(self, directory: str, tree: Mapping[str, Sequence[Any]]) -> None:
        """Keep a host copy of each shard of ``tree`` this process holds, until :meth:`stash` (the newest saves)."""
        shards: dict[str, np.ndarray] = {}
        for state, leaves in tree.items():
            for i, v in enumerate(leaves):
                for s in v.addressable_shards:
                    key = shard_key(state, i, self._index_of(s.index, v.shape))
                    if key not in shards:
                        shards[key] = np.array(s.data, copy=True)  # its own: a later step may donate the buffer
        self.kept[directory] = shards
        while len(self.kept) > KEPT:
            self.kept.popitem(last=False)

    def stash(self, h: Mapping[str, Any]) -> dict[str, Any]:
        """Push the shards kept from the save into ``h["dir"]`` to ``h["targets"]`` (in the background)."""
        shards = self.kept.pop(str(h["dir"]), None)
        if shards is None:
            return {"stashed": False, "why": "no host copy of that save is kept (an older one, or not kept)"}
        self._pushing = [t for t in self._pushing if t.is_alive()]
        t = threading.Thread(target=self._push, args=(dict(h), shards), name="stash", daemon=True)
        t.start()
        self._pushing.append(t)
        return {"stashed": True, "shards": len(shards)}

    def _push(self, h: dict[str, Any], shards: dict[str, np.ndarray]) -> None:
        from rallypoint.proto import codec

        states = {k: [a] for k, a in shards.items()}
        nbytes = sum(a.nbytes for a in shards.values())
        for target in map(_peer, h["targets"]):
            header = pb.ReplicaHeader(
                to=pb.Identity(cluster=str(h["cluster"]), worker_id=target.worker_id, incarnation=target.incarnation),
                job=str(h["job"]), slice=str(h["part"]), step=int(h["step"]), checksum=str(h["checksum"]),
                from_worker=str(h["from_worker"]), from_incarnation=int(h["from_incarnation"]))
            t0 = time.perf_counter()
            try:
                r = self.peers().stub(target.address, target.worker_id).PushReplica(codec.replica_chunks(header, states),
                                                                                    timeout=PUSH_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - the other holder, or the disk, serves instead
                self.log.warning("replica.push_failed", part=h["part"], step=h["step"], holder=target.worker_id,
                                 error=f"{type(exc).__name__}: {exc}")
                continue
            self.log.info("replica.pushed" if r.stored else "replica.push_refused", part=h["part"], step=h["step"],
                          holder=target.worker_id, bytes=nbytes, push_s=round(time.perf_counter() - t0, 4),
                          reason=r.reason or None)

    def finish(self, timeout_s: float = FINISH_S) -> bool:
        """Wait (bounded) for the pushes still under way (a member leaving its group does not cut them short);
        whether they all ended."""
        end = time.monotonic() + timeout_s
        for t in self._pushing:
            t.join(max(0.0, end - time.monotonic()))
        self._pushing = [t for t in self._pushing if t.is_alive()]
        return not self._pushing

    def fetch(self, h: Mapping[str, Any], need: list[str]) -> tuple[dict[str, np.ndarray] | None, str, str]:
        """This member's part from the first of ``h["sources"]`` whose copy is the commit's: (shards, holder, why)."""
        from rallypoint.proto import codec

        whys = []
        for source in map(_peer, h["sources"]):
            try:
                stream = self.peers().stub(source.address, source.worker_id).FetchReplica(pb.FetchReplicaRequest(
                    to=pb.Identity(cluster=str(h["cluster"]), worker_id=source.worker_id,
                                   incarnation=source.incarnation),
                    job=str(h["job"]), slice=str(h["part"]), step=int(h["step"])), timeout=PUSH_TIMEOUT_S)
                header, states = codec.assemble_replica(stream)
            except Exception as exc:  # noqa: BLE001 - the next source, or the disk
                details = exc.details() if isinstance(exc, grpc.RpcError) else ""
                whys.append(f"{source.worker_id}: {details or f'{type(exc).__name__}: {exc}'}")
                continue
            shards = {k: leaves[0] for k, leaves in states.items() if len(leaves) == 1}
            why = ("its commit checksum is not the commit's" if header.checksum != h["checksum"]
                   else check_part(shards, need, h["listing"]))
            if not why:
                return shards, source.worker_id, ""
            whys.append(f"{source.worker_id}: {why}")
        return None, "", "; ".join(whys) or "no source was named"
