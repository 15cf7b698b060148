"""What a gang member may touch: its own job's values, checkpoint folder and copies (docs/security.md).

A member process runs requests of whoever drives it, with its worker's devices, files and TLS key. Its
worker starts one only for a gang the leader placed there (the device leases of ``leases/<worker>/<index>``
name the job and slice: :func:`rallypoint.workers.gang.link.relay`) and tells it, in settings a driver
cannot set, the job and the folders of the job's checkpoints. :func:`check_request` then refuses (a
``ValueError``: the member answers ``{"error"}``, its group stays) a request that reaches past them:

* ``save``, ``restore``: a ``dir`` outside the job's folders (resolved, so no ``..`` or symlink leads out);
* ``send``: a value under another job's transfer header;
* ``stash``, ``restore_parts``: copies of another job's parts.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

class MemberRefused(ValueError):
    """A ``Member`` call's settings are not a member's, or name devices not leased to it (named, with what to
    send instead)."""


DIR_OPS = frozenset({"save", "restore"})
JOB_OPS = frozenset({"stash", "restore_parts"})


def within(path: str, roots: Sequence[str]) -> bool:
    """Whether ``path``, resolved, lies in one of ``roots`` (resolved)."""
    real = os.path.realpath(path)
    for root in roots:
        base = os.path.realpath(root)
        if real == base or real.startswith(base.rstrip(os.sep) + os.sep):
            return True
    return False


def check_request(header: Mapping[str, Any], *, job: str, dirs: Sequence[str]) -> None:
    """ValueError naming what ``header`` reaches past (the member's ``job`` and its checkpoint ``dirs``).
    ``job`` "": a member started without bounds (a group formed in one process, by tests)."""
    if not job:
        return
    op = header.get("op")
    if op in DIR_OPS:
        d = str(header.get("dir", ""))
        if not dirs or not within(d, dirs):
            raise ValueError(f"{op} of {d!r} refused: a member of job {job!r} reads and writes checkpoints only "
                             f"under the job's folder ({', '.join(dirs) or 'none: the job keeps no checkpoints'})")
    elif op == "send":
        from rallypoint.proto import rallypoint_pb2 as pb

        t = pb.TransferHeader.FromString(base64.b64decode(str(header.get("transfer", ""))))
        if t.job != job:
            raise ValueError(f"send of a value of job {t.job!r} refused: this member serves job {job!r} only")
    elif op in JOB_OPS and str(header.get("job", "")) != job:
        raise ValueError(f"{op} for job {header.get('job')!r} refused: this member serves job {job!r} only")


def leased_dirs(store: Any, keys: Any, worker: str, job: str, slice_name: str, device_ids: Sequence[int]) -> list[str]:
    """The checkpoint folders of ``job`` once this ``worker``'s own store shows the leader leased it every device
    of ``device_ids`` for ``job``'s slice ``slice_name`` (``leases/<worker>/<index>``, which the leader writes).

    Raises:
        MemberRefused: no job, slice or devices named, or a device not leased to them (which one, and to whom).
        StoreError: etcd could not be read (the driver's formation fails and is tried again).
    """
    from rallypoint.etcd.cluster_records import Holder
    from rallypoint.etcd.store import Get

    if not job or not slice_name or not device_ids:
        raise MemberRefused(f"a member on worker {worker} must name its job, slice and leased devices "
                            f"(got job {job!r}, slice {slice_name!r}, devices {list(device_ids)}): "
                            "members start only for a gang the leader placed here")
    r = store.txn([], [Get(keys.lease(worker, int(d))) for d in device_ids] + [Get(keys.job(job))])
    for d, read in zip(device_ids, r.reads, strict=False):
        try:
            holder = Holder.from_json(read[0].value) if read else None
        except (ValueError, KeyError, TypeError):
            holder = None
        if holder is None or (holder.job, holder.slice) != (job, slice_name):
            held = f"held by job {holder.job!r} slice {holder.slice!r}" if holder else "leased to nobody"
            raise MemberRefused(f"device {d} of worker {worker} is {held}, not by job {job!r} slice "
                                f"{slice_name!r}: the leader placed no such gang member here")
    record = r.reads[-1]
    try:
        run_dir = str(json.loads(record[0].value).get("run_dir") or "") if record else ""
    except (ValueError, AttributeError):
        run_dir = ""
    return [os.path.dirname(run_dir.rstrip(os.sep))] if run_dir else []  # the job's folder: every run of it


def host_arguments(given: Sequence[Mapping[str, Any]], payloads: Sequence[bytes], args: int) -> dict[int, Any]:
    """The small host arguments a ``call`` carries, by argument index (numpy arrays over its payloads).

    Raises:
        ValueError: what does not fit: an index outside the program's ``args`` arguments or given twice, a
            payload count or size that differs from what the header declares.
    """
    import numpy as np

    if len(given) != len(payloads):
        raise ValueError(f"a call declares {len(given)} host arguments and carries {len(payloads)} payloads")
    out: dict[int, Any] = {}
    for g, p in zip(given, payloads, strict=True):
        i = int(g["arg"])
        if not 0 <= i < args or i in out:
            raise ValueError(f"host argument {i} refused: the program takes {args} arguments, each given once")
        dtype, shape = np.dtype(str(g["dtype"])), tuple(int(x) for x in g["shape"])
        if dtype.hasobject or len(p) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"host argument {i}: {len(p)} bytes do not hold a {dtype} array of shape {shape}")
        out[i] = np.frombuffer(p, dtype=dtype).reshape(shape)
    return out
