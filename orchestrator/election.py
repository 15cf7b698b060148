"""Coordinator leader election through etcd, with fenced writes.

A candidate holds its own etcd lease and creates the leader key on it in a
transaction that succeeds only if the key does not exist. The winner's **term**
is the create revision of the leader key: unique, increasing, and a fencing
token. Every write the leader makes goes through :meth:`LeaderElection.fenced_txn`,
which adds ``create_revision(leader) == term`` to the transaction, so a deposed
leader (its lease expired while it was stopped, and a standby took the key) has
its writes refused by etcd itself and steps down. The leader also checks its
local lease deadline before each write (see :mod:`rallypoint.etcd.lease`).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Sequence

from rallypoint.basics.clock import SYSTEM_CLOCK, Clock
from rallypoint.basics.errors import Fenced, NotLeader, StoreError
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.lease import LeaseKeeper
from rallypoint.basics.logs import get_logger
from rallypoint.etcd.store import Compare, Get, Op, Put, Store, TxnResult, created_at, key_missing


class LeaderElection:
    """One candidate in the coordinator election.

    Args:
        store: the coordination store.
        keys: the cluster's key schema.
        candidate_id: this coordinator's id.
        ttl_s: leader lease TTL; a dead leader is replaced within about this long.
        clock: injectable clock.
        address: this coordinator's gRPC address, published in the leader key.
        metrics_address: its Prometheus endpoint ("": none), in its coordinator record and the leader key.

    Attributes:
        published: more of this coordinator's addresses (e.g. ``dashboard``), published in its
            coordinator key and the leader key; set them before the first :meth:`try_acquire`.
    """

    def __init__(
        self, store: Store, keys: Keys, candidate_id: str, *, ttl_s: int = 2, clock: Clock = SYSTEM_CLOCK,
        address: str = "", metrics_address: str = "",
    ) -> None:
        self.store = store
        self.address = address
        self.published: dict[str, str] = {}
        self.metrics_address = metrics_address
        self.keys = keys
        self.candidate_id = candidate_id
        self.ttl_s = ttl_s
        self.clock = clock
        self.term: int | None = None
        self._lost = threading.Event()
        self.keeper: LeaseKeeper | None = None
        self.log = get_logger("rallypoint.election", cluster=keys.cluster, coordinator=candidate_id)

    def _on_lease_lost(self, reason: str) -> None:
        self._lost.set()

    def _new_keeper(self) -> LeaseKeeper:
        keeper = LeaseKeeper(
            self.store,
            self.ttl_s,
            who=f"coordinator {self.candidate_id}",
            on_lost=self._on_lease_lost,
            clock=self.clock,
            log_fields={"cluster": self.keys.cluster, "coordinator": self.candidate_id},
        )
        keeper.start()
        return keeper

    def try_acquire(self) -> bool:
        """One campaign attempt: become leader if nobody leads. Returns whether we lead."""
        if self.keeper is None or self.keeper.fence.dead:
            self._lost.clear()
            self.keeper = self._new_keeper()
            self.store.put(
                self.keys.coordinator(self.candidate_id),
                json.dumps({"coordinator": self.candidate_id, "pid": os.getpid(), **self.published,
                            **({"metrics_address": self.metrics_address} if self.metrics_address else {})}),
                lease=self.keeper.lease_id,
            )
        self.keeper.fence.check()
        value = json.dumps(
            {"coordinator": self.candidate_id, "pid": os.getpid(), "host": socket.gethostname(), "address": self.address,
             **self.published, **({"metrics_address": self.metrics_address} if self.metrics_address else {})}
        )
        r = self.store.txn(
            [key_missing(self.keys.leader)],
            [Put(self.keys.leader, value, lease=self.keeper.lease_id)],
            [Get(self.keys.leader)],
        )
        if r.succeeded:
            self.term = r.revision
            self.log.info("leader.elected", term=self.term, lease=f"{self.keeper.lease_id:x}")
            return True
        current = r.reads[0][0] if r.reads and r.reads[0] else None
        if current is not None and current.lease == self.keeper.lease_id:
            # Our own earlier attempt applied (an indeterminate write that did land).
            self.term = current.create_revision
            self.log.info("leader.elected", term=self.term, lease=f"{self.keeper.lease_id:x}")
            return True
        return False

    def current_leader(self) -> tuple[str, int] | None:
        """``(coordinator id, term)`` of the current leader, or None."""
        kv = self.store.get(self.keys.leader)
        if kv is None:
            return None
        return kv.json()["coordinator"], kv.create_revision

    @property
    def is_leader(self) -> bool:
        """Whether we believe we lead (term set and local fence valid)."""
        return self.term is not None and self.keeper is not None and self.keeper.fence.valid()

    def check(self) -> None:
        """Raise :class:`NotLeader` unless we lead and our lease deadline has not passed."""
        if self.term is None or self.keeper is None:
            raise NotLeader(f"coordinator {self.candidate_id}", "not the leader")
        try:
            self.keeper.fence.check()
        except Fenced as exc:
            raise NotLeader(exc.who, exc.reason) from None

    def fenced_txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = (), *,
        term: int | None = None,
    ) -> TxnResult:
        """A transaction that applies only while this coordinator still holds its term
        (``term``: only while it holds that one; see :class:`TermWriter`).

        Raises:
            NotLeader: the local fence tripped, or etcd refused the write because
                another coordinator now holds the leader key (the caller must step
                down), or ``term`` is not the current term (that writer's term is over).
        """
        if term is not None and self.term is not None and term != self.term:
            raise NotLeader(f"coordinator {self.candidate_id}", f"term {term} is over (this coordinator now leads "
                                                                 f"term {self.term})")
        try:
            self.check()
        except NotLeader as exc:
            self.step_down(exc.reason, keep_lease=self.keeper is not None and not self.keeper.fence.dead)
            raise
        assert self.term is not None
        fence = created_at(self.keys.leader, self.term)
        r = self.store.txn([fence, *compares], success, [Get(self.keys.leader), *failure])
        if r.succeeded:
            return r
        leader_now = r.reads[0][0] if r.reads[0] else None
        if leader_now is None or leader_now.create_revision != self.term:
            term = self.term
            self.step_down("write refused: leader key belongs to another term")
            raise NotLeader(
                f"coordinator {self.candidate_id}",
                f"write refused by etcd: term {term} is over "
                f"(leader term now {leader_now.create_revision if leader_now else 'none'})",
            )
        return TxnResult(succeeded=False, revision=r.revision, reads=r.reads[1:])

    def confirm(self) -> None:
        """A fenced no-op round trip: raises :class:`NotLeader` if we were deposed."""
        self.fenced_txn([], [])

    def step_down(self, reason: str, *, keep_lease: bool = False) -> None:
        """Stop acting as leader.

        With ``keep_lease`` (only the local deadline passed, e.g. etcd was briefly
        unreachable) the lease is kept: if a later keepalive succeeds, the lease
        never expired, nobody else could have taken the leader key, and the next
        campaign finds the key still ours and resumes the same term. Otherwise
        the lease is revoked so that the next campaign starts clean.
        """
        if self.term is not None:
            self.log.warning("leader.deposed", term=self.term, reason=reason, lease_kept=keep_lease)
        self.term = None
        if self.keeper is not None and not keep_lease:
            try:
                self.keeper.stop(revoke=True)
            except StoreError:
                pass
            self.keeper = None

    def resign(self) -> None:
        """Give up leadership (on shutdown): revoking our lease deletes the leader key."""
        if self.term is not None:
            self.log.info("leader.resigned", term=self.term)
        self.term = None
        if self.keeper is not None:
            self.keeper.stop(revoke=True)
            self.keeper = None

    @property
    def lease_lost(self) -> threading.Event:
        return self._lost

    def writer(self) -> TermWriter:
        """A writer bound to the current term (raises :class:`NotLeader` when there is none)."""
        self.check()
        assert self.term is not None
        return TermWriter(self, self.term)


class TermWriter:
    """Fenced writes of one term only: whoever captured it (a job's executor) writes under
    that term or not at all, even after this coordinator leads again under a newer one."""

    def __init__(self, election: LeaderElection, term: int) -> None:
        self.election, self.term = election, term
        self._keeper = election.keeper  # the lease the term lives on: a new one means the term is over

    def txn(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """:meth:`LeaderElection.fenced_txn` under this writer's term. Raises :class:`NotLeader`."""
        return self.election.fenced_txn(compares, success, failure, term=self.term)

    @property
    def holds(self) -> bool:
        """Whether the coordinator leads under this term right now (local view)."""
        return self.election.term == self.term and self.election.is_leader

    @property
    def over(self) -> bool:
        """Whether this term is over for good: another term leads here, or the lease is gone."""
        keeper = self.election.keeper
        return (self.election.term is not None and self.election.term != self.term) or keeper is None \
            or keeper is not self._keeper or keeper.fence.dead
