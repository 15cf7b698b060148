"""Registration of a worker incarnation in etcd: one transaction, one lease.

The worker key and one key per device are created together on the worker's etcd
lease, only if no incarnation of the worker id is registered. The create
revision of the worker key is the new **incarnation**.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rallypoint.basics.errors import WriteIndeterminate
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import KeyValue, Put, Store, key_missing


def try_register(
    store: Store, keys: Keys, worker_id: str, record: dict[str, Any], devices: Sequence[dict[str, Any]], lease_id: int
) -> tuple[int | None, KeyValue | None]:
    """One registration attempt.

    Returns ``(incarnation, None)`` on success, or ``(None, holder)`` where
    ``holder`` is the key of the incarnation still registered (None if unknown).
    An indeterminate write is resolved by reading the key back: if it carries our
    lease, the write did apply.
    """
    wkey = keys.worker(worker_id)
    ops = [Put(wkey, json.dumps(record), lease=lease_id)]
    ops += [Put(keys.device(worker_id, int(d["index"])), json.dumps(d), lease=lease_id) for d in devices]
    try:
        r = store.txn([key_missing(wkey)], ops)
        if r.succeeded:
            return r.revision, None
    except WriteIndeterminate:
        pass
    kv = store.get(wkey)
    if kv is not None and kv.lease == lease_id:
        return kv.create_revision, None
    return None, kv
