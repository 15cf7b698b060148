"""Coordinator leader election through etcd, with fenced writes.

A candidate holds its own etcd lease and creates the leader key on it in a
transaction that succeeds only if the key does not exist. The winner's **term**
is the create revision of the leader key: unique, increasing, and a fencing
token. Every write the leader makes goes through :meth:`LeaderElection.fenced_txn`,
which adds ``create_revision(leader) == term`` to the transaction, so a deposed
leader (its lease expired while it was stopped, and a standby took the key) has
its writes refused by etcd itself and steps down. The leader also checks its
local lease deadline before each write (see :mod:`rallypoint.etcd.lease`).

The term and the lease keeper change together under one lock: the coordinator thread
campaigns and steps down while executor threads write and, when etcd refuses them,
step down too. A step-down on behalf of a writer names the writer's term and does
nothing once that term is over, so it can never drop the lease of a newer campaign;
and a writer's fence is always its own term, never whatever term the coordinator
holds by the time its transaction is built.
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
from rallypoint.etcd.records import REQUIRED, Fields, skip_bad
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
        self._lock = threading.RLock()  # term and keeper change together, under it
        self._epoch = 0  # counts every change of term under the lock (a kept lease may resume the same term)
        self.term: int | None = None
        self.keeper: LeaseKeeper | None = None
        self.log = get_logger("rallypoint.election", cluster=keys.cluster, coordinator=candidate_id)

    def _new_keeper(self) -> LeaseKeeper:
        keeper = LeaseKeeper(
            self.store,
            self.ttl_s,
            who=f"coordinator {self.candidate_id}",
            clock=self.clock,
            log_fields={"cluster": self.keys.cluster, "coordinator": self.candidate_id},
        )
        keeper.start()
        return keeper

    def try_acquire(self) -> bool:
        """One campaign attempt: become leader if nobody leads. Returns whether we lead.

        The etcd round trips run outside the lock; the term is taken under it only if the
        lease the campaign ran on is still ours (a step-down meanwhile revoked it: no term).
        """
        with self._lock:
            keeper = self.keeper
        if keeper is None or keeper.fence.dead:
            keeper = self._new_keeper()
            with self._lock:
                self.keeper = keeper
            self.store.put(
                self.keys.coordinator(self.candidate_id),
                json.dumps({"coordinator": self.candidate_id, "pid": os.getpid(), **self.published,
                            **({"metrics_address": self.metrics_address} if self.metrics_address else {})}),
                lease=keeper.lease_id,
            )
        keeper.fence.check()
        value = json.dumps(
            {"coordinator": self.candidate_id, "pid": os.getpid(), "host": socket.gethostname(), "address": self.address,
             **self.published, **({"metrics_address": self.metrics_address} if self.metrics_address else {})}
        )
        r = self.store.txn(
            [key_missing(self.keys.leader)],
            [Put(self.keys.leader, value, lease=keeper.lease_id)],
            [Get(self.keys.leader)],
        )
        won: int | None = None
        if r.succeeded:
            won = r.revision
        else:
            current = r.reads[0][0] if r.reads and r.reads[0] else None
            if current is not None and current.lease == keeper.lease_id:
                # Our own earlier attempt applied (an indeterminate write that did land).
                won = current.create_revision
        if won is None:
            return False
        with self._lock:
            if self.keeper is not keeper:
                return False  # stepped down (or resigned) while campaigning: that lease is gone
            self.term = won
            self._epoch += 1
        self.log.info("leader.elected", term=won, lease=f"{keeper.lease_id:x}")
        return True

    def current_leader(self) -> tuple[str, int] | None:
        """``(coordinator id, term)`` of the current leader, or None."""
        kv = self.store.get(self.keys.leader)
        name = skip_bad(lambda: Fields.of(kv, "leader").text("coordinator", REQUIRED)) if kv is not None else None
        if kv is None or name is None:
            return None
        return name, kv.create_revision

    def held(self) -> tuple[int | None, LeaseKeeper | None]:
        """``(term, keeper)``, read together."""
        with self._lock:
            return self.term, self.keeper

    @property
    def is_leader(self) -> bool:
        """Whether we believe we lead (term set and local fence valid)."""
        term, keeper = self.held()
        return term is not None and keeper is not None and keeper.fence.valid()

    def check(self) -> None:
        """Raise :class:`NotLeader` unless we lead and our lease deadline has not passed."""
        term, keeper = self.held()
        if term is None or keeper is None:
            raise NotLeader(f"coordinator {self.candidate_id}", "not the leader")
        try:
            keeper.fence.check()
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
        with self._lock:
            held, epoch = self.term, self._epoch
        if term is None:
            term = held
        if term is not None and held is not None and term != held:
            raise NotLeader(f"coordinator {self.candidate_id}", f"term {term} is over (this coordinator now leads "
                                                                 f"term {held})")
        try:
            self.check()
        except NotLeader as exc:
            if term is not None:  # what this call saw, and only that, stops; its lease stays while it may live
                self._step_down(exc.reason, keep_lease=None, term=term, epoch=epoch)
            raise
        if term is None:  # no term when this call began: take the one the check found, if any
            term = self.held()[0]
            if term is None:
                raise NotLeader(f"coordinator {self.candidate_id}", "not the leader")
        fence = created_at(self.keys.leader, term)  # the writer's term, whatever the coordinator holds by now
        r = self.store.txn([fence, *compares], success, [Get(self.keys.leader), *failure])
        if r.succeeded:
            return r
        leader_now = r.reads[0][0] if r.reads[0] else None
        if leader_now is None or leader_now.create_revision != term:
            self.step_down("write refused: leader key belongs to another term", term=term)
            raise NotLeader(
                f"coordinator {self.candidate_id}",
                f"write refused by etcd: term {term} is over "
                f"(leader term now {leader_now.create_revision if leader_now else 'none'})",
            )
        return TxnResult(succeeded=False, revision=r.revision, reads=r.reads[1:])

    def confirm(self) -> None:
        """A fenced no-op round trip: raises :class:`NotLeader` if we were deposed."""
        self.fenced_txn([], [])

    def step_down(self, reason: str, *, keep_lease: bool | None = False, term: int | None = None) -> None:
        """Stop acting as leader.

        With ``keep_lease`` (only the local deadline passed, e.g. etcd was briefly
        unreachable) the lease is kept: if a later keepalive succeeds, the lease
        never expired, nobody else could have taken the leader key, and the next
        campaign finds the key still ours and resumes the same term. Otherwise
        the lease is revoked so that the next campaign starts clean. ``keep_lease=None``:
        keep it while it may still live (its keeper's fence is not dead).

        ``term``: step down from that term only; if it is over already (we stood down, or a
        newer campaign leads), nothing changes, so a late writer of an old term never drops
        the term or lease of a newer campaign.
        """
        self._step_down(reason, keep_lease=keep_lease, term=term, epoch=None)

    def _step_down(self, reason: str, *, keep_lease: bool | None, term: int | None, epoch: int | None) -> None:
        """:meth:`step_down`; with ``epoch``, only if nothing changed since the caller looked (a campaign
        that resumed the same term with its kept lease is a change)."""
        with self._lock:
            if (term is not None and self.term != term) or (epoch is not None and self._epoch != epoch):
                return
            self._epoch += 1
            old_term, keeper = self.term, self.keeper
            if keep_lease is None:
                keep_lease = keeper is not None and not keeper.fence.dead
            self.term = None
            if not keep_lease:
                self.keeper = None
        if old_term is not None:
            self.log.warning("leader.deposed", term=old_term, reason=reason, lease_kept=keep_lease)
        if keeper is not None and not keep_lease:
            try:
                keeper.stop(revoke=True)
            except StoreError:
                pass

    def resign(self) -> None:
        """Give up leadership (on shutdown): revoking our lease deletes the leader key."""
        with self._lock:
            term, keeper = self.term, self.keeper
            self.term, self.keeper = None, None
            self._epoch += 1
        if term is not None:
            self.log.info("leader.resigned", term=term)
        if keeper is not None:
            keeper.stop(revoke=True)

    def writer(self) -> TermWriter:
        """A writer bound to the current term (raises :class:`NotLeader` when there is none)."""
        self.check()
        term, keeper = self.held()
        if term is None:
            raise NotLeader(f"coordinator {self.candidate_id}", "not the leader")
        return TermWriter(self, term, keeper)


class TermWriter:
    """Fenced writes of one term only: whoever captured it (a job's executor) writes under
    that term or not at all, even after this coordinator leads again under a newer one."""

    def __init__(self, election: LeaderElection, term: int, keeper: LeaseKeeper | None = None) -> None:
        self.election, self.term = election, term
        # the lease the term lives on: a new one means the term is over
        self._keeper = keeper if keeper is not None else election.held()[1]

    def txn(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """:meth:`LeaderElection.fenced_txn` under this writer's term. Raises :class:`NotLeader`."""
        return self.election.fenced_txn(compares, success, failure, term=self.term)

    @property
    def holds(self) -> bool:
        """Whether the coordinator leads under this term right now (local view)."""
        return self.election.held()[0] == self.term and self.election.is_leader

    @property
    def over(self) -> bool:
        """Whether this term is over for good: another term leads here, or the lease is gone."""
        term, keeper = self.election.held()
        return (term is not None and term != self.term) or keeper is None \
            or keeper is not self._keeper or keeper.fence.dead
