"""Chaos scenarios: a TOML file naming a job, a cluster and the faults to inject.

```toml
name = "kill-one-worker"
description = "SIGKILL the worker of one pipeline stage mid-run"

[job]
file = "examples/pipeline_mlp.py"   # relative to the scenario file, else to the project root
steps = 40                          # optional: override the program's
checkpoint_every = 5
policy = "partial"                  # or "restart-all"
window = 0                          # steps in flight; 0: the leader decides (the checkpoint interval)
on_no_spare = "wait"                # or "fail", or "shrink"; wait_timeout_s = 60
verify_every = 0                    # verify one slice's steps every K-th cut (docs/integrity.md; 0: never)
settings = { LM_VARIANT = "pipeline" }  # optional: the job's settings, as `rallypoint run --set NAME=VALUE`
reference = "process"               # or "cluster": the fault-free run on this cluster first (a multi-host
                                    # slice's collectives sum in another order than one process: docs/multihost.md)

[cluster]
workers = 4                         # default: one per slice
spares = 1
devices_per_worker = 1
coordinators = 2
etcd_members = 1                    # 3 for the etcd faults
lease_ttl_s = 2
compile_cache = true                # the workers' shared compilation cache (false: every load compiles)
corrupt_replicas = false            # every in-memory checkpoint copy is damaged (a restore must read the disk)
supervise = false                   # true: killed workers and coordinators are started again (a new incarnation)

[second_job]                        # optional: another job on the same cluster, submitted mid-run
file = "examples/urgent.py"
priority = 10                       # the first job's priority: [job] priority (default 0)
at_step = 10                        # submitted once the first job reaches this step
steps = 40

[expect]
outcome = "finished"                # or "failed", with `reason` a regular expression
time_bound_s = 180

[[faults]]                          # at a step, or at a time since the job started
kind = "kill"
target = "stage2"                   # a slice, a node, or a worker (w0, ...)
at_step = 12                        # or at_s = 5.0
# duration_s = 3                    # hang, straggler, partition, leader_hang, etcd_quorum, disk_*, tenant
# until_step = 100                  # or: in force until the job reaches this step (instead of duration_s)
# devices = 2                       # tenant: devices of the target worker another holder takes (default: all free)

[[faults]]                          # silent data corruption: the worker holding the target slice (or node) flips
kind = "corrupt"                    # one bit of the slice's state at each update from at_step on ("persist", the
target = "stage1"                   # default) or at the first one ("once"); nothing detects it yet, so the run's
at_step = 5                         # final-state-digest invariant fails (workers/corruption.py, docs/chaos.md)
mode = "once"

[[faults]]                          # an operator's suspend (no target): saved at the next step boundary, every
kind = "suspend"                    # device released; once the job is SUSPENDED the harness waits resume_after_s
at_step = 12                        # and resumes it (ResumeJob), then follows it to its end
resume_after_s = 1.0                # default 1.0; 0 to 600

[random]                            # optional: faults at random, the same schedule for the same seed
seed = 7
mtbf_s = 8.0                        # mean time between failures
duration_s = 60.0                   # faults are drawn over this long
kinds = ["kill", "hang"]
targets = ["stage0", "stage1"]      # default: every slice
```

:func:`load_scenario` checks everything and names the offending field;
:meth:`Scenario.schedule` turns the fixed and random faults into one list, the
random part drawn from ``random.Random(seed)`` so one seed gives one schedule.
"""

from __future__ import annotations

import random
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rallypoint.basics.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

KINDS = {
    # kind: (needs a target, takes a duration)
    "kill": (True, False), "preempt": (True, False), "drain": (True, False), "hang": (True, True), "straggler": (True, True), "partition": (True, True),
    "leader_kill": (False, False), "leader_hang": (False, True),
    "etcd_kill": (False, False), "etcd_quorum": (False, True),
    "corrupt_checkpoint": (True, False), "truncate_checkpoint": (True, False),
    "disk_full": (False, True), "disk_readonly": (False, True),
    "tenant": (True, True),
    "suspend": (False, False),  # an operator's action, not a fault: the harness resumes the job (resume_after_s)
    "corrupt": (True, False),  # silent data corruption of the target slice's state (workers/corruption.py)
}
DEFAULT_DURATION_S = 3.0
DEFAULT_RESUME_AFTER_S = 1.0  # a suspend: how long the job stays SUSPENDED before the harness resumes it
OPERATOR_KINDS = frozenset({"suspend"})  # scheduled only: never drawn at random ([random].kinds refuses them)
# Scheduled only as well: nothing detects a corruption yet, so a campaign drawing one would always fail its digest.
SCHEDULED_ONLY = OPERATOR_KINDS | {"corrupt"}
CORRUPT_MODES = ("persist", "once")


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    target: str = ""
    at_step: int | None = None
    at_s: float | None = None
    duration_s: float = 0.0
    origin: str = "fixed"  # or "random"
    devices: int = 0  # tenant: how many of the worker's free devices it takes (0: all)
    until_step: int | None = None  # in force until the job reaches this step (instead of duration_s)
    resume_after_s: float | None = None  # suspend: seconds the job stays SUSPENDED before the harness resumes it
    mode: str = ""  # corrupt: "persist" (every state update from the step on) or "once"

    def describe(self) -> str:
        when = f"step {self.at_step}" if self.at_step is not None else f"{self.at_s:.2f}s"
        until = f" until step {self.until_step}" if self.until_step is not None else ""
        resume = f", resumed {self.resume_after_s:g}s after" if self.resume_after_s is not None else ""
        mode = f" ({self.mode})" if self.mode else ""
        return f"{self.kind}{' ' + self.target if self.target else ''} at {when}{until}{resume}{mode}"


@dataclass(frozen=True)
class SecondJob:
    """Another job submitted on the same cluster once the first reaches ``at_step``; it must finish bitwise."""

    job_file: Path
    at_step: int
    priority: int = 0
    steps: int | None = None


@dataclass(frozen=True)
class RandomFaults:
    seed: int
    mtbf_s: float
    duration_s: float
    kinds: tuple[str, ...]
    targets: tuple[str, ...] = ()
    fault_duration_s: float = DEFAULT_DURATION_S


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    path: Path
    job_file: Path
    steps: int | None = None
    checkpoint_every: int | None = None
    policy: str = "partial"
    window: int = 0
    on_no_spare: str = "wait"
    settings: tuple[tuple[str, str], ...] = ()  # the job's settings (``--set NAME=VALUE``), sorted by name
    wait_timeout_s: float = 60.0
    verify_every: int = 0  # verify one slice's steps every this many cuts (docs/integrity.md; 0: never)
    workers: int | None = None
    spares: int = 1
    devices_per_worker: int | None = None
    coordinators: int = 2
    etcd_members: int = 1
    lease_ttl_s: int = 2
    compile_cache: bool = True
    corrupt_replicas: bool = False
    supervise: bool = False
    expect_outcome: str = "finished"
    expect_reason: str = ""
    time_bound_s: float = 300.0
    faults: tuple[FaultSpec, ...] = ()
    random: RandomFaults | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    reference: str = "process"  # or "cluster": what the final state must equal bitwise (docs/chaos.md)
    second_job: SecondJob | None = None

    def with_seed(self, seed: int) -> Scenario:
        """The scenario with its random faults drawn from ``seed`` instead."""
        if self.random is None:
            return self
        return replace(self, random=replace(self.random, seed=seed))

    @property
    def seed(self) -> int | None:
        return self.random.seed if self.random else None

    def schedule(self, slices: list[str]) -> list[FaultSpec]:
        """Every fault to inject: the fixed ones, then the random ones (by time)."""
        out = list(self.faults)
        r = self.random
        if r is not None:
            rng = random.Random(r.seed)
            targets = list(r.targets) or sorted(slices)
            t = rng.expovariate(1.0 / r.mtbf_s)
            while t < r.duration_s:
                kind = rng.choice(r.kinds)
                target = rng.choice(targets) if KINDS[kind][0] else ""
                out.append(FaultSpec(kind, target, at_s=round(t, 3),
                                     duration_s=r.fault_duration_s if KINDS[kind][1] else 0.0, origin="random"))
                t += rng.expovariate(1.0 / r.mtbf_s)
        return out

    @property
    def kinds(self) -> set[str]:
        return {f.kind for f in self.faults} | set(self.random.kinds if self.random else ())


def _get(table: dict[str, Any], key: str, typ: type | tuple[type, ...], where: str, default: Any = None) -> Any:
    if key not in table:
        return default
    value = table[key]
    if isinstance(value, bool) and typ is not bool or not isinstance(value, typ):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise ConfigError(f"{where}.{key}: expected {names}, got {value!r}")
    return value


def _unknown(table: dict[str, Any], known: set[str], where: str) -> None:
    extra = sorted(set(table) - known)
    if extra:
        raise ConfigError(f"{where}: unknown keys {extra}; known: {sorted(known)}")


def _job_file(path: Path, file: str, where: str) -> Path:
    if not file:
        raise ConfigError(f"{where}.file: name the job file (e.g. examples/pipeline_mlp.py)")
    job_file = (path.parent / file) if (path.parent / file).exists() else ROOT / file
    if not job_file.exists():
        raise ConfigError(f"{where}.file: {file!r} exists neither beside the scenario nor in {ROOT}")
    return job_file


def load_scenario(path: Path) -> Scenario:
    """Read and check a scenario file.

    Raises:
        ConfigError: unreadable TOML, a missing or mistyped field, an unknown fault
            kind, or a fault without the trigger or target it needs; the message
            names the file and the field.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read scenario {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"scenario {path} is not valid TOML: {exc}") from None
    w = str(path)
    _unknown(data, {"name", "description", "job", "cluster", "expect", "faults", "random", "second_job"}, w)
    name = _get(data, "name", str, w) or path.stem
    job = _get(data, "job", dict, w, {})
    _unknown(job, {"file", "steps", "checkpoint_every", "policy", "window", "on_no_spare", "wait_timeout_s",
                   "priority", "reference", "settings", "verify_every"}, f"{w} [job]")
    settings = _get(job, "settings", dict, f"{w} [job]", {})
    for k, v in settings.items():
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise ConfigError(f"{w} [job].settings.{k}: a setting is a string or a number, got {v!r}")
    reference = _get(job, "reference", str, f"{w} [job]", "process")
    if reference not in ("process", "cluster"):
        raise ConfigError(f"{w} [job].reference: {reference!r} is not 'process' or 'cluster'")
    if _get(job, "verify_every", int, f"{w} [job]", 0) < 0:
        raise ConfigError(f"{w} [job].verify_every: verify every K-th cut, K >= 0 (0: never)")
    on_no_spare = _get(job, "on_no_spare", str, f"{w} [job]", "wait")
    if on_no_spare not in ("wait", "fail", "shrink"):
        raise ConfigError(f"{w} [job].on_no_spare: {on_no_spare!r} is not 'wait', 'fail' or 'shrink'")
    job_file = _job_file(path, _get(job, "file", str, f"{w} [job]", ""), f"{w} [job]")
    second = None
    if "second_job" in data:
        sj = _get(data, "second_job", dict, w)
        where = f"{w} [second_job]"
        _unknown(sj, {"file", "priority", "at_step", "steps"}, where)
        at = _get(sj, "at_step", int, where, 0)
        if at < 1:
            raise ConfigError(f"{where}.at_step: submit the second job at a step >= 1")
        second = SecondJob(_job_file(path, _get(sj, "file", str, where, ""), where), at,
                           _get(sj, "priority", int, where, 0), _get(sj, "steps", int, where))
    policy = _get(job, "policy", str, f"{w} [job]", "partial")
    if policy not in ("partial", "restart-all"):
        raise ConfigError(f"{w} [job].policy: {policy!r} is not 'partial' or 'restart-all'")
    cluster = _get(data, "cluster", dict, w, {})
    _unknown(cluster, {"workers", "spares", "devices_per_worker", "coordinators", "etcd_members", "lease_ttl_s",
                       "compile_cache", "corrupt_replicas", "supervise"},
             f"{w} [cluster]")
    expect = _get(data, "expect", dict, w, {})
    _unknown(expect, {"outcome", "reason", "time_bound_s"}, f"{w} [expect]")
    outcome = _get(expect, "outcome", str, f"{w} [expect]", "finished")
    if outcome not in ("finished", "failed"):
        raise ConfigError(f"{w} [expect].outcome: {outcome!r} is not 'finished' or 'failed'")
    faults = []
    for i, f in enumerate(_get(data, "faults", list, w, [])):
        where = f"{w} [[faults]] #{i + 1}"
        if not isinstance(f, dict):
            raise ConfigError(f"{where}: expected a table")
        _unknown(f, {"kind", "target", "at_step", "at_s", "duration_s", "until_step", "devices", "resume_after_s",
                     "mode"}, where)
        kind = _get(f, "kind", str, where, "")
        if kind not in KINDS:
            raise ConfigError(f"{where}.kind: {kind!r} is not one of {sorted(KINDS)}")
        target = _get(f, "target", str, where, "")
        if KINDS[kind][0] and not target:
            raise ConfigError(f"{where}.target: a {kind} fault needs a target (a slice, node or worker)")
        if kind in OPERATOR_KINDS and target:
            raise ConfigError(f"{where}.target: a {kind} acts on the whole job; drop target ({target!r})")
        resume_after: float | None = None
        if kind == "suspend":
            resume_after = float(_get(f, "resume_after_s", (int, float), where, DEFAULT_RESUME_AFTER_S))
            if not 0 <= resume_after <= 600:
                raise ConfigError(f"{where}.resume_after_s: seconds the job stays suspended before the harness "
                                  f"resumes it, 0 to 600; got {resume_after:g}")
        elif "resume_after_s" in f:
            raise ConfigError(f"{where}.resume_after_s: only a suspend is resumed; a {kind} fault takes no "
                              "resume_after_s")
        mode = ""
        if kind == "corrupt":
            mode = _get(f, "mode", str, where, "persist")
            if mode not in CORRUPT_MODES:
                raise ConfigError(f"{where}.mode: {mode!r} is not one of {', '.join(CORRUPT_MODES)}")
        elif "mode" in f:
            raise ConfigError(f"{where}.mode: only a corrupt fault takes a mode; a {kind} fault takes none")
        at_step, at_s = _get(f, "at_step", int, where), _get(f, "at_s", (int, float), where)
        if (at_step is None) == (at_s is None):
            raise ConfigError(f"{where}: give exactly one of at_step and at_s")
        if (at_step is not None and at_step < 1) or (at_s is not None and at_s < 0):
            raise ConfigError(f"{where}: at_step must be >= 1 and at_s >= 0")
        duration = float(_get(f, "duration_s", (int, float), where, DEFAULT_DURATION_S if KINDS[kind][1] else 0.0))
        until_step = _get(f, "until_step", int, where)
        if until_step is not None:
            if not KINDS[kind][1]:
                raise ConfigError(f"{where}.until_step: a {kind} fault has no duration; drop until_step")
            if "duration_s" in f:
                raise ConfigError(f"{where}: give at most one of duration_s and until_step")
            if at_step is None or until_step <= at_step:
                raise ConfigError(f"{where}.until_step: needs at_step and must be past it (at_step {at_step}, "
                                  f"until_step {until_step})")
            duration = 0.0
        devices = _get(f, "devices", int, where, 0)
        if devices < 0 or (devices and kind != "tenant"):
            raise ConfigError(f"{where}.devices: only a tenant fault takes devices (>= 1; 0 or absent: all free ones)")
        faults.append(FaultSpec(kind, target, at_step, None if at_s is None else float(at_s), duration,
                                devices=devices, until_step=until_step, resume_after_s=resume_after, mode=mode))
    rnd = None
    if "random" in data:
        r = _get(data, "random", dict, w)
        where = f"{w} [random]"
        _unknown(r, {"seed", "mtbf_s", "duration_s", "kinds", "targets", "fault_duration_s"}, where)
        kinds = tuple(_get(r, "kinds", list, where, ["kill"]))
        bad = [k for k in kinds if k not in KINDS or k in SCHEDULED_ONLY]
        if bad or not kinds:
            raise ConfigError(f"{where}.kinds: {bad or 'empty'}: pick from {sorted(set(KINDS) - SCHEDULED_ONLY)} "
                              f"({sorted(SCHEDULED_ONLY)}: [[faults]] only, never at random)")
        mtbf = float(_get(r, "mtbf_s", (int, float), where, 10.0))
        if mtbf <= 0:
            raise ConfigError(f"{where}.mtbf_s must be > 0")
        rnd = RandomFaults(int(_get(r, "seed", int, where, 0)), mtbf, float(_get(r, "duration_s", (int, float), where, 60.0)),
                           kinds, tuple(_get(r, "targets", list, where, [])),
                           float(_get(r, "fault_duration_s", (int, float), where, DEFAULT_DURATION_S)))
    etcd_members = _get(cluster, "etcd_members", int, f"{w} [cluster]", 1)
    if etcd_members not in (1, 3):
        raise ConfigError(f"{w} [cluster].etcd_members: 1 or 3, got {etcd_members}")
    s = Scenario(
        name=name, description=_get(data, "description", str, w, ""), path=path, job_file=job_file,
        steps=_get(job, "steps", int, f"{w} [job]"), checkpoint_every=_get(job, "checkpoint_every", int, f"{w} [job]"),
        policy=policy, window=_get(job, "window", int, f"{w} [job]", 0), on_no_spare=on_no_spare,
        settings=tuple(sorted((str(k), str(v)) for k, v in settings.items())),
        wait_timeout_s=float(_get(job, "wait_timeout_s", (int, float), f"{w} [job]", 60.0)),
        verify_every=_get(job, "verify_every", int, f"{w} [job]", 0),
        workers=_get(cluster, "workers", int, f"{w} [cluster]"), spares=_get(cluster, "spares", int, f"{w} [cluster]", 1),
        devices_per_worker=_get(cluster, "devices_per_worker", int, f"{w} [cluster]"),
        coordinators=_get(cluster, "coordinators", int, f"{w} [cluster]", 2), etcd_members=etcd_members,
        lease_ttl_s=_get(cluster, "lease_ttl_s", int, f"{w} [cluster]", 2),
        compile_cache=_get(cluster, "compile_cache", bool, f"{w} [cluster]", True),
        corrupt_replicas=_get(cluster, "corrupt_replicas", bool, f"{w} [cluster]", False),
        supervise=_get(cluster, "supervise", bool, f"{w} [cluster]", False),
        expect_outcome=outcome, expect_reason=_get(expect, "reason", str, f"{w} [expect]", ""),
        time_bound_s=float(_get(expect, "time_bound_s", (int, float), f"{w} [expect]", 300.0)),
        faults=tuple(faults), random=rnd, priority=_get(job, "priority", int, f"{w} [job]", 0), reference=reference, second_job=second,
    )
    etcd_kinds = {"etcd_kill", "etcd_quorum"} & s.kinds
    if etcd_kinds and s.etcd_members != 3:
        raise ConfigError(f"{w}: faults {sorted(etcd_kinds)} need [cluster].etcd_members = 3")
    if {"leader_kill", "leader_hang"} & s.kinds and s.coordinators < 2:
        raise ConfigError(f"{w}: leader faults need [cluster].coordinators >= 2 (a standby to take over)")
    if "suspend" in s.kinds and s.expect_outcome != "finished":
        raise ConfigError(f"{w}: a suspend is resumed by the harness and its job must end finished; "
                          f"[expect].outcome is {s.expect_outcome!r}")
    if "suspend" in s.kinds and s.checkpoint_every == 0:
        raise ConfigError(f"{w}: a suspend saves the job at a step boundary; [job].checkpoint_every = 0 keeps no "
                          "checkpoints (the leader refuses the suspend)")
    return s
