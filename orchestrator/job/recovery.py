"""A job's settings and the record of each recovery: plain data, no I/O.

:class:`JobSettings` is what a ``JobSpec`` asks for (defaults filled in,
checked). :class:`Reshard` is one change of a slice's device count. :class:`RecoveryRecord`
is one recovery as the executor measures it: the lost workers and slices, the checkpoint
step, where each restored slice's checkpoint was read from (``restore_tiers``: ``"memory"``,
a peer's in-memory copy, or ``"disk"``), the plan, and its phases, each a duration in seconds:

* ``detection``: the lost worker's last event to its loss being noticed (an upper
  bound on how long the death went unseen; events flow constantly while it runs);
* ``fencing``: revoking its lease (its device leases go with it);
* ``remap``: choosing and leasing spare devices (includes waiting for a spare: ``spare_wait_s``);
* ``restore``: loading programs and the checkpoint on the spare, rewiring the survivors;
* ``replay``: the replaying nodes re-running their instances from the checkpoint up
  to where they had got (the lost slice is back at the step it had reached);
* ``catch_up``: until every node is back where it was when the loss was noticed.

``mttr_s`` is the sum of the first five: the loss to the lost work redone.

Warm spares (``recovery/warm.py``): ``warm`` says of each moved slice whether its new
worker held every program of the slice compiled ahead; ``first_calls`` what the first
call of the slice's nodes there paid to get their executables: ``source`` ``"warm"``
(every node's came from the warm cache), ``"compiled"`` (every node compiled it) or
``"mixed"``, and ``compile_s``, the seconds those first calls spent on it (0 when warm).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rallypoint.recovery.nonfinite import nonfinite_mode
from rallypoint.recovery.spikes import SpikeSettings
from rallypoint.orchestrator.job.watchdog import DEFAULT_COMPILE_TIMEOUT_S
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.decide import (DEFAULT_FAILURE_WINDOW_S, DEFAULT_MAX_FAULTS, DEFAULT_MAX_PREEMPTIONS,
                                        FailurePolicy)
from rallypoint.recovery.stragglers import (DEFAULT_FACTOR, DEFAULT_PERSIST, DEFAULT_PROBATION_S, DEFAULT_REPEAT_WINDOW_S,
                                            DEFAULT_WINDOW, StragglerSettings)
from rallypoint.recovery.warm import DEFAULT_WARM_SPARES

POLICIES = ("partial", "restart-all")
ON_NO_SPARE = ("wait", "fail", "shrink")
DEFAULT_CHECKPOINT_EVERY = 10
DEFAULT_KEEP = 3
DEFAULT_WAIT_S = 60.0
DEFAULT_LOG_LIMIT = 256 << 20
DEFAULT_STALL_S = 60.0
PHASES = ("detection", "fencing", "remap", "restore", "replay", "catch_up")


@dataclass(frozen=True)
class JobSettings:
    policy: str
    on_no_spare: str
    wait_timeout_s: float
    checkpoint_every: int
    keep_checkpoints: int
    log_limit_bytes: int
    stall_timeout_s: float = DEFAULT_STALL_S
    stragglers: StragglerSettings = StragglerSettings()
    warm_spares: int = DEFAULT_WARM_SPARES  # spares that compile the job's programs ahead (0: off)
    failure_policy: FailurePolicy = FailurePolicy()  # at most so many recoveries per window (docs/recovery.md)
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S  # no stall before this while the nodes waited on compile
    on_nonfinite: str = "stop"  # a metric that is not finite: stop the job there, warn or roll back (job/metrics.py)
    spikes: SpikeSettings = SpikeSettings()  # loss spikes: off, warn or roll back (job/rollback.py)

    @classmethod
    def from_spec(cls, spec: pb.JobSpec) -> JobSettings:
        """The settings a spec asks for, defaults filled in.

        Raises:
            ValueError: an unknown policy, or a negative number; the message names the field.
        """
        policy = spec.policy or "partial"
        if policy not in POLICIES:
            raise ValueError(f"recovery policy {policy!r} is not one of {list(POLICIES)}")
        on_no_spare = spec.on_no_spare or "wait"
        if on_no_spare == "shrink" and not any(v for n in spec.nodes for v in n.variants):
            raise ValueError("on_no_spare='shrink' needs a slice that may run on fewer devices: declare it "
                             "prog.slice(name, devices=(min, max)) so its programs are exported for those counts")
        if on_no_spare not in ON_NO_SPARE:
            raise ValueError(f"on_no_spare {on_no_spare!r} is not one of {list(ON_NO_SPARE)}")
        if spec.window < 0:
            raise ValueError(f"window must be >= 0 (0: the leader decides it from checkpoint_every and "
                             f"log_limit_bytes), got {spec.window}")
        for name in ("checkpoint_every", "keep_checkpoints", "wait_timeout_s", "log_limit_bytes", "stall_timeout_s"):
            if getattr(spec, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: the default), got {getattr(spec, name)}")
        for name in ("max_faults", "max_preemptions", "failure_window_s", "compile_timeout_s"):
            if getattr(spec, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: the default), got {getattr(spec, name)}")
        for name in ("straggler_factor", "straggler_window", "straggler_persist", "straggler_probation_s",
                     "straggler_repeat_window_s"):
            if getattr(spec, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: the default), got {getattr(spec, name)}")
        warm = int(spec.warm_spares) if spec.HasField("warm_spares") else DEFAULT_WARM_SPARES
        if warm < 0:
            raise ValueError(f"warm_spares must be >= 0 (0: no warm spares; unset: {DEFAULT_WARM_SPARES}), got {warm}")
        window = int(spec.straggler_window or DEFAULT_WINDOW)
        stragglers = StragglerSettings(spec.stragglers or "migrate", float(spec.straggler_factor or DEFAULT_FACTOR),
                                       window, int(spec.straggler_persist or min(DEFAULT_PERSIST, window)),
                                       probation_s=float(spec.straggler_probation_s or DEFAULT_PROBATION_S),
                                       repeat_window_s=float(spec.straggler_repeat_window_s or DEFAULT_REPEAT_WINDOW_S))
        return cls(policy, on_no_spare, float(spec.wait_timeout_s or DEFAULT_WAIT_S),
                   int(spec.checkpoint_every or DEFAULT_CHECKPOINT_EVERY), int(spec.keep_checkpoints or DEFAULT_KEEP),
                   int(spec.log_limit_bytes or DEFAULT_LOG_LIMIT), float(spec.stall_timeout_s or DEFAULT_STALL_S),
                   stragglers, warm,
                   FailurePolicy(int(spec.max_faults or DEFAULT_MAX_FAULTS),
                                 int(spec.max_preemptions or DEFAULT_MAX_PREEMPTIONS),
                                 float(spec.failure_window_s or DEFAULT_FAILURE_WINDOW_S)),
                   float(spec.compile_timeout_s or DEFAULT_COMPILE_TIMEOUT_S), nonfinite_mode(spec),
                   _spikes(spec, int(spec.checkpoint_every or DEFAULT_CHECKPOINT_EVERY)))


def _spikes(spec: pb.JobSpec, every: int) -> SpikeSettings:
    """The spike policy; a rollback (on a spike, or ``on_nonfinite = "rollback"``) needs checkpoints enough to go
    back ``spike_rewind`` steps. Raises ValueError naming the settings."""
    spikes = SpikeSettings.from_spec(spec, every)
    if spikes.mode != "rollback" and nonfinite_mode(spec) != "rollback":
        return spikes
    keep = int(spec.keep_checkpoints or DEFAULT_KEEP)
    if keep * every < spikes.rewind + 2 * every:
        raise ValueError(f"a rollback goes back spike_rewind={spikes.rewind} steps, but keep_checkpoints={keep} "
                         f"cuts every {every} steps keep only {keep * every}: keep at least "
                         f"{-(-(spikes.rewind + 2 * every) // every)} checkpoints, or rewind less")
    return spikes


@dataclass(frozen=True)
class Reshard:
    """One change of a slice's device count (a shrink, or a grow back): what ``resharded`` lists.

    ``step``: the step a drain moved the slice at (None: a placement or a recovery's remap).
    """

    slice: str
    devices_before: int
    devices_after: int
    why: str
    at: float  # wall clock
    step: int | None = None

    def to_json(self) -> dict[str, Any]:
        """As the job record, ``job.finished`` and the chaos runner read it: slice, from, to, why, at (and step)."""
        return {"slice": self.slice, "from": self.devices_before, "to": self.devices_after, "why": self.why,
                "at": self.at, **({"step": self.step} if self.step is not None else {})}


@dataclass
class RecoveryRecord:
    """One recovery, measured (see the module doc)."""

    number: int
    lost: dict[str, list[str]]  # worker -> its slices
    reasons: dict[str, str]
    detected_at: float  # wall clock
    detected_mono: float
    detection_s: float
    policy: str = ""
    checkpoint_step: int = 0
    escalated: str = ""  # why partial became restart-all, if it did
    moved: dict[str, str] = field(default_factory=dict)  # slice -> new worker
    restore_tiers: dict[str, str] = field(default_factory=dict)  # restored slice -> "memory" | "disk"
    replay_nodes: list[str] = field(default_factory=list)
    planned_instances: dict[str, int] = field(default_factory=dict)
    attempts: int = 0
    spare_wait_s: float = 0.0  # of the remap phase, the seconds it waited for a worker with room
    marks: dict[str, float] = field(default_factory=dict)  # phase -> monotonic end
    # replay tracking
    targets: dict[str, int] = field(default_factory=dict)  # replaying node -> step it had reached
    expected: Counter[str] = field(default_factory=Counter)
    seen: Counter[str] = field(default_factory=Counter)
    generations: dict[str, int] = field(default_factory=dict)  # worker -> generation that replays
    frontier: dict[str, int] = field(default_factory=dict)  # every node -> step it had reached
    # warm spares
    warm: dict[str, bool] = field(default_factory=dict)  # moved slice -> its new worker held all its programs warm
    first_calls: dict[str, dict[str, Any]] = field(default_factory=dict)  # moved slice -> source, compile_s, nodes

    def mark(self, phase: str, at: float) -> None:
        """Phase ``phase`` (one of :data:`PHASES`) ended at monotonic time ``at``."""
        self.marks[phase] = at

    def observe(self, worker: str, generation: int, node: str, step: int) -> None:
        """An instance done: counted when a runtime loaded for this recovery replayed it."""
        if (self.generations.get(worker) == generation and node in self.targets
                and self.checkpoint_step <= step < self.targets[node]):
            self.seen[node] += 1

    def first_call(self, worker: str, generation: int, slice_name: str, source: str, compile_s: float) -> None:
        """A node's first call on a runtime loaded for this recovery, on a moved slice: what it paid to compile."""
        if self.generations.get(worker) != generation or self.moved.get(slice_name) != worker:
            return
        fc = self.first_calls.setdefault(slice_name, {"source": source, "compile_s": 0.0, "nodes": 0})
        if fc["source"] != source:
            fc["source"] = "mixed"
        fc["compile_s"] = round(fc["compile_s"] + compile_s, 4)
        fc["nodes"] += 1

    @property
    def replayed(self) -> bool:
        """Every planned replay instance was seen."""
        return all(self.seen[n] >= k for n, k in self.expected.items())

    @property
    def done(self) -> bool:
        return "catch_up" in self.marks

    def phases(self) -> dict[str, float]:
        out = {"detection": round(self.detection_s, 4)}
        prev = self.detected_mono
        for p in PHASES[1:]:
            if p not in self.marks:
                break
            out[p] = round(self.marks[p] - prev, 4)
            prev = self.marks[p]
        return out

    def to_json(self) -> dict[str, Any]:
        ph = self.phases()
        mttr = sum(ph[p] for p in PHASES[:5] if p in ph) if "replay" in ph else None
        return {
            "recovery": self.number, "lost": self.lost, "reasons": self.reasons, "detected_at": self.detected_at,
            "policy": self.policy, "checkpoint_step": self.checkpoint_step, "escalated": self.escalated,
            "moved": self.moved, "restore_tiers": self.restore_tiers, "replay_nodes": self.replay_nodes,
            "planned_instances": self.planned_instances, "warm": self.warm, "first_calls": self.first_calls,
            "attempts": self.attempts, "phases": ph, "spare_wait_s": round(self.spare_wait_s, 4),
            "mttr_s": round(mttr, 4) if mttr is not None else None,
        }
