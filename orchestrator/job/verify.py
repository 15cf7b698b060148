"""Silent data corruption caught: shadow re-execution of a slice's steps on a spare worker (docs/integrity.md).

A verification is a rehearsed recovery. When the job's cut reaches a step ``c`` (every
``verify_every``-th cut, while the steps verifications re-ran stay within ``verify_fraction`` of the
slice-steps the job ran, when that is set), :class:`JobVerifier` picks one slice (seeded, so a campaign is
reproducible) whose inputs all come from its own sources and states, and an idle worker
(registered, uncordoned, holding no device, not the job's). In a thread of its own (nothing
of the job waits for it, but its end: each slice's final state is verified before the job
ends, :meth:`JobVerifier.settled`) it loads that slice there under a job name of its own
(``<job>.verify``) from the slice's commit at an earlier cut ``p``, with the run's skipped
batches, grants it the steps up to ``c``, and reads back the checksum of the state it reached
(``LoadJobRequest.verify``: the worker compares instead of saving). Equal to the primary's
commit at ``c``: ``job.verified``. The commit at ``p`` is the slice's newest *trusted* cut when
it is still kept (step 0, the inits, is trusted; a match from a trusted start makes ``c`` trusted),
so a run of verifications confirms a chain.

A mismatch is adjudicated: the same steps run on a third worker. The odd one out is the suspect:
the primary (its worker gave the commit) or the first verifier. A suspect is convicted: the
executor cordons it (``by: suspect-sdc``; ``rallypoint uncordon`` takes it back), and when it is
the primary, the job goes back to the newest consistent cut at or before the slice's newest
trusted one (the commits past it dropped) and every slice reloads there, the suspect's slices on
other workers (job/rollback.py). Three different checksums: the steps are not deterministic
there (``job.verify_inconclusive``), nobody is convicted. No third worker: the mismatch is
reported, nobody is convicted.

Not verified: slices that read another slice's outputs (their inputs are in the producers'
output logs, which a verification does not hold back), multi-host slices, and jobs placed on a
worker whose kernels are not deterministic (docs/platforms.md): their steps do not give the same
bytes twice.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from rallypoint.basics.tls import TlsConfig
from rallypoint.etcd.cluster_view import ClusterSnapshot
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.orchestrator.job.grants import StepGrant
from rallypoint.orchestrator.job.workers import JobWorkers
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.load_plan import SlicePlace, load_requests
from rallypoint.recovery.skips import Skips

SUFFIX = ".verify"
WAIT_S = 120.0  # a verification not answered within this long is given up (reported, nobody convicted)
CORDON_BY = "suspect-sdc"
KEPT = 16  # mismatches the job record lists in full (the counts are kept whole)


def closed_slices(spec: pb.JobSpec) -> list[str]:
    """The slices with states whose nodes read only their own slice's outputs and states (verifiable alone)."""
    node_slice = {n.name: n.slice for n in spec.nodes}
    state_slice = {s.name: s.slice for s in spec.states}
    open_ = {n.slice for n in spec.nodes for b in n.inputs
             if (b.kind in (pb.InputBinding.REF, pb.InputBinding.GATHER) and node_slice.get(b.node) != n.slice)
             or (b.kind == pb.InputBinding.STATE and state_slice.get(b.state) != n.slice)}
    gangs = {s.slice for s in spec.slices if s.members}
    return sorted(set(state_slice.values()) - open_ - gangs)


@dataclass
class Check:
    """One verification: ``slice``'s steps ``start .. step - 1`` on ``verifier``, against ``primary``'s commit."""

    number: int
    slice: str
    start: int
    step: int
    primary: str
    verifier: str
    commit: CheckpointCommit
    origin: CheckpointCommit | None  # the commit at ``start`` (None: the inits)
    devices: int
    first: Check | None = None  # an adjudication: the check whose mismatch it settles
    result: pb.VerifiedState | None = None
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"verification": self.number, "slice": self.slice, "from_step": self.start, "to_step": self.step,
                "primary": self.primary, "verifier": self.verifier, "primary_checksum": self.commit.checksum,
                **({"checksum": self.result.checksum} if self.result is not None else {}),
                **({"error": self.error} if self.error else {})}


@dataclass(frozen=True)
class Conviction:
    """A worker found computing wrong numbers: ``primary`` True when it held the slice (the job goes back to
    ``trusted``, the newest trusted cut of the slice)."""

    worker: str
    slice: str
    step: int
    primary: bool
    trusted: int
    evidence: dict[str, Any] = field(default_factory=dict)


class JobVerifier:
    """One job's verifications (see the module doc). Its methods run on the executor's thread; each
    verification's load, grants and wait run on a thread of its own and come back through :meth:`poll`.

    Args:
        spec: the job; ``cluster``: its cluster's name; ``tls``: the leader's identity towards the workers.
        term: the job's term (its number, the commits, the cluster's workers).
        placement: slice -> where it runs now; ``skips``: the run's skipped batches now.
        event: the executor's ``event(name, step, **detail)``; ``log``: its logger.
    """

    def __init__(self, spec: pb.JobSpec, *, cluster: str, tls: TlsConfig | None, term: Any,
                 placement: Callable[[], dict[str, SlicePlace]], skips: Callable[[], Skips],
                 cluster_now: Callable[[], ClusterSnapshot], deterministic: Callable[[], bool],
                 event: Callable[..., None], log: Any) -> None:
        self.spec, self.cluster, self.tls, self.term, self.deterministic = spec, cluster, tls, term, deterministic
        self.placement, self.skips, self.cluster_now, self.event, self.log = placement, skips, cluster_now, event, log
        self.every, self.cuts, self.number = 0, 0, 0
        self.rng = random.Random(0)
        self.run_dir: Path | None = None
        self.checkpoint_every, self.log_limit_bytes = 0, 0
        self.slices: list[str] = []
        self.trusted: dict[str, set[int]] = {}
        self.active: Check | None = None
        self.done: queue.Queue[Check] = queue.Queue()
        self.final_checked: set[str] = set()  # slices whose final state was verified (or given up)
        self.verified = 0  # verifications that matched
        self.fraction = 0.0  # > 0: the budget, a fraction of the slice-steps the job ran
        self.spent = 0  # slice-steps the budgeted verifications re-ran (started)
        self.mismatches: list[dict[str, Any]] = []  # the newest KEPT, each with its verdict
        self.counts = {"mismatched": 0, "convicted": 0}  # all of the run's

    def configure(self, every: int, seed: int, run_dir: Path | None, checkpoint_every: int,
                  log_limit_bytes: int, *, fraction: float = 0.0) -> None:
        """The job's settings once checked; nothing is verified without checkpoints. ``fraction`` > 0: the budget
        (every cut a candidate when ``every`` is 0)."""
        self.fraction = fraction
        every = every or (1 if fraction > 0 else 0)
        self.every = every if run_dir is not None else 0
        self.rng = random.Random(seed)
        self.run_dir, self.checkpoint_every, self.log_limit_bytes = run_dir, checkpoint_every, log_limit_bytes
        self.slices = closed_slices(self.spec)
        self.trusted = {s: {0} for s in self.slices}
        if every and not self.slices:
            self.log.warning("verify.none", reason="no slice with states reads only its own outputs and states")

    def to_json(self) -> dict[str, Any]:
        return {"verified": self.verified, **self.counts, "budget_spent_steps": self.spent,
                "trusted": {s: sorted(steps)[-KEPT:] for s, steps in self.trusted.items()},
                "mismatches": list(self.mismatches)}

    def adopt(self, record: Any) -> None:
        """A resumed or adopted run: the trusted cuts, counts and mismatches its job record keeps (what is not well
        formed is left out: trust starts again from step 0 for that slice)."""
        if not isinstance(record, dict):
            return
        trusted = record.get("trusted") if isinstance(record.get("trusted"), dict) else {}
        for s in self.trusted:
            steps = trusted.get(s)
            if isinstance(steps, list):
                self.trusted[s] |= {p for p in steps if isinstance(p, int) and not isinstance(p, bool) and p >= 0}
        for key in ("verified", "mismatched", "convicted", "budget_spent_steps"):
            n = record.get(key)
            if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                if key == "verified":
                    self.verified = n
                elif key == "budget_spent_steps":
                    self.spent = n
                else:
                    self.counts[key] = n
        kept = record.get("mismatches")
        self.mismatches = [m for m in kept if isinstance(m, dict)][-KEPT:] if isinstance(kept, list) else []

    def _mismatch(self, entry: dict[str, Any]) -> None:
        self.counts["mismatched"] += 1
        self.counts["convicted"] += entry["verdict"] == "convicted"
        self.mismatches = [*self.mismatches, entry][-KEPT:]

    # -- starting -------------------------------------------------------------------------------

    def cut_moved(self, cut: int, busy: bool) -> None:
        """The job's cut moved to ``cut``: every ``every``-th time, verify one slice's steps up to it (unless one is
        under way, or the job is ``busy``: a recovery, a drain or a rollback)."""
        if not self.every or not self.slices or cut <= 0:
            return
        self.cuts += 1
        if self.cuts % self.every or self.active is not None or busy:
            return
        if self._on():
            self._verify(self.rng.choice(self.slices), cut, budgeted=True)

    def settled(self) -> bool:
        """At the final cut: whether the job may end. With verifications on, each slice's final state is verified
        first (one at a time; a slice with no idle worker to verify it on is given up, logged)."""
        if not self.every or not self.slices or not self._on():
            return True
        if self.active is not None:
            return False
        for s in self.slices:
            if s not in self.final_checked and int(self.spec.steps) not in self.trusted[s]:
                self.final_checked.add(s)
                if self._verify(s, int(self.spec.steps)):
                    return False
        return True

    def _on(self) -> bool:
        if not self.deterministic():
            self.every = 0
            self.log.warning("verify.off", reason="a worker of the job runs nondeterministic kernels: its steps are "
                             "not verified bitwise")
        return self.every > 0

    def _verify(self, s: str, cut: int, *, budgeted: bool = False) -> bool:
        """Start verifying slice ``s``'s steps up to ``cut``, from its newest trusted commit still kept (else the
        newest before): whether it started. ``budgeted``: not when its steps would pass the budget (``fraction``
        of the slice-steps the job ran up to ``cut``)."""
        commits = {c.step: c for c in self.term.commits().get(s, [])}
        if cut not in commits:
            return False
        older = sorted((p for p in commits if p < cut), reverse=True)
        trusted = [p for p in older if p in self.trusted[s]]
        start = trusted[0] if trusted else (older[0] if older else 0)
        if budgeted and self.fraction > 0 and self.spent + cut - start > self.fraction * cut * len(self.spec.slices):
            return False
        started = self._start(s, start, cut, commits.get(start), commits[cut], exclude=set())
        if started and budgeted:
            self.spent += cut - start
        return started

    def _start(self, s: str, start: int, step: int, origin: CheckpointCommit | None, commit: CheckpointCommit, *,
               exclude: set[str], first: Check | None = None) -> bool:
        place = self.placement().get(s)
        if place is None:
            return False
        devices = len(place.devices)
        spare = self._spare(devices, exclude | {place.worker}, like=place.worker)
        if spare is None:
            self.log.info("verify.no_spare", slice=s, step=step)
            return False
        self.number += 1
        check = Check(self.number, s, start, step, place.worker, spare.info.worker, commit, origin, devices, first)
        try:
            req = self._request(check, spare)
        except ValueError as exc:
            self.log.warning("verify.not_started", slice=s, error=str(exc))
            return False
        self.active = check
        self.log.info("verify.started", **check.to_json())
        threading.Thread(target=self._run, args=(check, req, spare.info.address), name=f"verify-{check.number}",
                         daemon=True).start()
        return True

    def _spare(self, devices: int, exclude: set[str], like: str) -> Any:
        """An idle worker with ``devices`` devices of the platform and kind of ``like``'s (the same bytes need the
        same hardware) and deterministic kernels: registered, uncordoned, holding none, not the job's."""
        snap = self.cluster_now()
        model = snap.workers.get(like)
        used = {p.worker for p in self.placement().values()} | exclude
        for w in sorted(snap.workers):
            ws = snap.workers[w]
            if (w not in used and not ws.cordoned and not ws.holders and len(ws.devices) >= devices
                    and ws.info.deterministic and model is not None and ws.info.platform == model.info.platform
                    and ws.info.device_kind == model.info.device_kind):
                return ws
        return None

    def _request(self, check: Check, spare: Any) -> pb.LoadJobRequest:
        spec = pb.JobSpec(job=self.spec.job, steps=self.spec.steps, microbatches=self.spec.microbatches,
                          slices=[s for s in self.spec.slices if s.slice == check.slice],
                          nodes=[n for n in self.spec.nodes if n.slice == check.slice],
                          states=[s for s in self.spec.states if s.slice == check.slice])
        place = SlicePlace(spare.info.worker, spare.info.address, spare.info.incarnation,
                           tuple(spare.devices[:check.devices]), spare.info.data_address)
        req = load_requests(spec, {check.slice: place}, cluster=self.cluster, term=self.term.term)[place.worker]
        req.job = self.spec.job[:63 - len(SUFFIX)] + SUFFIX
        req.checkpoint_every, req.checkpoint_dir = self.checkpoint_every, str(self.run_dir or "")
        req.log_limit_bytes, req.start_step, req.code_sha256 = self.log_limit_bytes, check.start, self.spec.code.sha256
        if check.origin is not None:
            o = check.origin
            req.restore.append(pb.CheckpointRef(slice=o.slice_name, step=o.step, path=o.path, checksum=o.checksum))
        self.skips().to_proto(req.skips)
        c = check.commit
        req.verify.CopyFrom(pb.Verification(job=self.spec.job, commit=pb.CheckpointRef(
            slice=c.slice_name, step=c.step, path=c.path, checksum=c.checksum)))
        return req

    def _run(self, check: Check, req: pb.LoadJobRequest, address: str) -> None:
        """The verification's thread: load, grant up to its step, wait for the checksum, unload."""
        workers = JobWorkers(req.job, self.tls)
        w = check.verifier
        try:
            failed = workers.load({w: req}, {w: address})
            if w in failed:
                check.error = f"the load failed: {failed[w]}"
                return
            workers.grant([StepGrant(w, check.step, check.start)])
            while check.result is None and not check.error:
                kind, (_, _, item) = workers.events.get(timeout=WAIT_S)
                if kind != "batch":
                    check.error = f"{kind}: {item}"
                for done in item if kind == "batch" else ():
                    if done.error:
                        check.error = done.error
                    elif done.HasField("verified"):
                        check.result = done.verified
        except queue.Empty:
            check.error = f"no answer within {WAIT_S:.0f} s"
        except grpc.RpcError as exc:
            check.error = f"{exc.code().name} {exc.details()}"
        finally:
            try:
                workers.unload(w)
            except grpc.RpcError:
                pass
            workers.close()
            self.done.put(check)

    # -- results --------------------------------------------------------------------------------

    def poll(self) -> Conviction | None:
        """A verification's result, if one came: reported; a mismatch adjudicated; a conviction returned."""
        try:
            check = self.done.get_nowait()
        except queue.Empty:
            return None
        self.active = None
        if check.error or check.result is None:
            self.log.warning("verify.failed", **check.to_json())
            self.event("job.verify_failed", check.step, **check.to_json())
            return None
        if check.first is None:
            if check.result.match:
                self.verified += 1
                if check.start in self.trusted[check.slice]:
                    self.trusted[check.slice].add(check.step)
                self.log.info("verify.matched", **check.to_json())
                self.event("job.verified", check.step, **check.to_json())
                return None
            self.log.error("verify.mismatch", **check.to_json())
            self.event("job.verify_mismatch", check.step, **check.to_json())
            if not self._start(check.slice, check.start, check.step, check.origin, check.commit,
                               exclude={check.verifier}, first=check):
                self._mismatch({**check.to_json(), "verdict": "unadjudicated: no third worker"})
                self.event("job.sdc", check.step, verdict="unadjudicated", **check.to_json())
            return None
        return self._adjudicated(check.first, check)

    def _adjudicated(self, first: Check, second: Check) -> Conviction | None:
        assert first.result is not None and second.result is not None
        third = second.result.checksum
        if third == first.commit.checksum:
            suspect, primary = first.verifier, False
        elif third == first.result.checksum:
            suspect, primary = first.primary, True
        else:
            self._mismatch({**first.to_json(), "third": second.to_json(), "verdict": "inconclusive"})
            self.event("job.verify_inconclusive", first.step, **first.to_json(), third=second.to_json())
            return None
        trusted = max(p for p in self.trusted[first.slice] if p <= first.start)
        evidence = {**first.to_json(), "third": second.to_json(), "suspect": suspect, "trusted_cut": trusted}
        self._mismatch({**evidence, "verdict": "convicted"})
        self.log.error("verify.convicted", **evidence)
        self.event("job.sdc", first.step, verdict="convicted", **evidence)
        return Conviction(suspect, first.slice, first.step, primary, trusted, evidence)

    def forget_from(self, cut: int) -> None:
        """The job went back to ``cut``: cuts past it are trusted no more (their commits are gone)."""
        self.trusted = {s: {p for p in steps if p <= cut} for s, steps in self.trusted.items()}
        self.final_checked.clear()
