"""Invariant checks over what a run left behind: plain data in, violations out.

These functions never talk to etcd; callers record the evidence (watch history,
final state) and pass it in, so the checks are tested on synthetic histories too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rallypoint.etcd.store import WatchEvent
from rallypoint.proto.digest import states_close


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant, with its evidence."""

    invariant: str
    key: str
    revision: int
    detail: str


def check_exclusive_device_leases(events: Iterable[WatchEvent]) -> list[Violation]:
    """No physical device is ever leased to two holders at once.

    ``events`` is the watch history of the ``leases/`` prefix, in revision order.
    A lease key may only be created when absent (version 1) and deleted while
    present; a put over an existing lease (version > 1) hands a held device to
    someone else without releasing it first.
    """
    held: dict[str, bytes] = {}
    violations: list[Violation] = []
    for ev in events:
        key = ev.kv.key
        if ev.type == "put":
            if key in held or ev.kv.version != 1:
                violations.append(Violation(
                    "exclusive-device-lease", key, ev.kv.mod_revision,
                    f"device leased while held: previous holder {held.get(key, b'?')!r}, new holder {ev.kv.value!r}",
                ))
            held[key] = ev.kv.value
        else:
            held.pop(key, None)
    return violations


# -- the chaos suite's invariants (chaos/runner.py gathers the evidence) ------------------------


@dataclass(frozen=True)
class Check:
    """One invariant's verdict, with the evidence a person can check."""

    name: str
    ok: bool
    evidence: str

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "ok": self.ok, "evidence": self.evidence}


def check_digest(got: str | None, expected: str, *, resharded: Sequence[Mapping[str, Any]] = (),
                 got_states: Mapping[str, Sequence[Any]] | None = None,
                 want_states: Mapping[str, Sequence[Any]] | None = None,
                 tolerance: Mapping[str, float] | None = None,
                 nondeterministic: Sequence[str] = ()) -> Check:
    """1. The final state is bitwise the fault-free run's; or, when the job changed a slice's
    device count (``resharded``, from ``job.finished``) or ran on workers without deterministic
    kernels (``nondeterministic_workers``: a GPU worker started ``--nondeterministic``,
    docs/platforms.md), within the tolerance it reports."""
    if not got:
        return Check("final-state-digest", False, f"the job produced no final state; fault-free digest {expected}")
    if resharded or nondeterministic:
        changes = ", ".join([*(f"{r['slice']} {r['from']}->{r['to']}" for r in resharded),
                             *(f"{w} without deterministic kernels" for w in nondeterministic)])
        if got_states is None or want_states is None or not tolerance:
            return Check("final-state-digest", False, f"not bitwise ({changes}) but the job reported no "
                         "final states or tolerance to compare with")
        ok, evidence = states_close(got_states, want_states, rtol=tolerance["rtol"], atol=tolerance["atol"])
        return Check("final-state-digest", ok, f"device counts changed or kernels nondeterministic ({changes}): "
                     f"compared to the fault-free run within a tolerance, not bitwise: {evidence}")
    return Check("final-state-digest", got == expected,
                 f"digest {got} {'==' if got == expected else '!='} fault-free {expected} (bitwise: no slice changed "
                 "its device count)")


@dataclass(frozen=True)
class NodeInfo:
    slice: str
    every: int
    per_microbatch: bool


def _instances(node: str, info: NodeInfo, start: int, stop: int, microbatches: int) -> set[tuple[str, int, int]]:
    first = -(-start // info.every) * info.every
    mbs = range(microbatches) if info.per_microbatch else (-1,)
    return {(node, s, m) for s in range(first, stop, info.every) for m in mbs}


def check_applied_once(runtimes: list[dict], nodes: dict[str, NodeInfo], *, microbatches: int, steps: int,
                       stateless: Collection[str] = ()) -> Check:
    """2. Every step applied exactly once per node, from the workers' instance records.

    ``runtimes``: the records of every runtime of the job, in load order (``read_records``);
    ``stateless``: the slices that hold no state. No runtime may run an instance twice,
    nor one of a step before the step it started at (its restored state has it applied).

    A slice's runtimes form a tree, not a chain: a runtime started at step ``k > 0``
    carries on from the checkpoint of step ``k`` (it must have restored exactly that
    step), and that checkpoint was made by whichever earlier runtime of the slice applied
    every instance before ``k``: not always the one loaded just before it (a leader lost
    mid-recovery leaves a replacement that replayed nothing, and the next leader's
    adoption reloads every slice from a newer cut that the lost worker's runtime had
    made). So each runtime started at ``k > 0`` needs a *producer*: an earlier runtime of
    the slice, itself started from a state applied exactly once, that ran every instance
    of the slice from its own start up to ``k``. The last runtime of the slice must run
    every instance from its start to the end of the job. Work a runtime did past the
    state someone carried on from was thrown away with it and is not counted.

    A slice without state carries nothing from step to step: its runtime may start at any
    step without restoring one (``restored_from`` None); every instance of it must have
    run in some runtime of the slice.
    """
    problems: list[str] = []
    slices = sorted({i.slice for i in nodes.values()})
    runs_checked = 0
    for s in slices:
        lineage = [r for r in runtimes if s in r.get("slices", ())]
        if not lineage:
            problems.append(f"slice {s}: no runtime recorded any instance")
            continue
        runs_checked += len(lineage)
        ran = [_ran_once(r, s, nodes, problems) for r in lineage]

        def want(start: int, stop: int, s: str = s) -> set[tuple[str, int, int]]:
            out: set[tuple[str, int, int]] = set()
            for n, info in nodes.items():
                if info.slice == s:
                    out |= _instances(n, info, start, stop, microbatches)
            return out

        if s in stateless:
            missing = want(0, steps) - set().union(*ran)
            if missing:
                problems.append(f"slice {s} (no state): no runtime of it ran {_listed(missing)}")
            continue
        valid: list[bool] = []  # per runtime, in load order: did it start from a state applied exactly once?
        for i, r in enumerate(lineage):
            valid.append(int(r["start_step"]) == 0 or _carried_on(i, lineage, ran, valid, want, problems, s))
        last, start = lineage[-1], int(lineage[-1]["start_step"])
        missing = want(start, steps) - ran[-1]
        if missing:
            problems.append(f"slice {s}: runtime {last['runtime']} (steps {start}..{steps}) never ran {_listed(missing)}")
    if problems:
        return Check("applied-exactly-once", False, "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else ""))
    return Check("applied-exactly-once", True, f"{runs_checked} runtimes over {len(slices)} slices: every instance of "
                 f"steps 0..{steps - 1} applied once along each slice's lineage")


def _listed(missing: set[tuple[str, int, int]]) -> str:
    shown = ", ".join(f"{n}@{st}/{m}" for n, st, m in sorted(missing, key=lambda k: (k[1], k[0], k[2]))[:5])
    return f"{len(missing)} instances: {shown}{' ...' if len(missing) > 5 else ''}"


def _ran_once(r: dict, s: str, nodes: dict[str, NodeInfo], problems: list[str]) -> set[tuple[str, int, int]]:
    """The instances of slice ``s`` runtime ``r`` ran; one run twice, or before its start, is a problem."""
    start = int(r["start_step"])
    seen: set[tuple[str, int, int]] = set()
    for x in r["instances"]:
        if x["n"] not in nodes or nodes[x["n"]].slice != s:
            continue
        key = (x["n"], int(x["s"]), int(x["m"]))
        if key in seen:
            problems.append(f"slice {s}: runtime {r['runtime']} ran {key[0]} step {key[1]} microbatch {key[2]} twice")
        elif key[1] < start:
            problems.append(f"slice {s}: runtime {r['runtime']} started at step {start} but ran {key[0]} step "
                            f"{key[1]} microbatch {key[2]}: applied again on a state that had it")
        seen.add(key)
    return seen


def _carried_on(i: int, lineage: list[dict], ran: list[set[tuple[str, int, int]]], valid: list[bool],
                want: Callable[[int, int], set[tuple[str, int, int]]], problems: list[str], s: str) -> bool:
    """Whether runtime ``lineage[i]`` (started at ``k > 0``) restored step ``k`` and an earlier runtime of the
    slice that started well (``valid``) applied every instance before ``k``; if not, says why in ``problems``."""
    r = lineage[i]
    k = int(r["start_step"])
    if r.get("restored_from") != k:
        problems.append(f"slice {s}: runtime {r['runtime']} started at step {k} but restored the checkpoint of step "
                        f"{r.get('restored_from')}: the steps between were not applied")
        return False
    gaps: list[tuple[int, set[tuple[str, int, int]]]] = []
    for j in reversed(range(i)):  # the newest producer first
        start = int(lineage[j]["start_step"])
        if start >= k:
            continue
        missing = want(start, k) - ran[j]
        if not missing and valid[j]:
            return True
        gaps.append((j, missing))
    if not gaps:
        problems.append(f"slice {s}: runtime {r['runtime']} restored the checkpoint of step {k}, but no earlier "
                        f"runtime of the slice started before step {k}")
        return False
    j, missing = min(gaps, key=lambda g: len(g[1]))  # the nearest miss (first found among the fewest missing)
    p = lineage[j]
    why = (f"never ran {_listed(missing)}" if missing else
           f"itself started from a state not applied exactly once (step {p['start_step']})")
    problems.append(f"slice {s}: runtime {r['runtime']} restored the checkpoint of step {k}, but no earlier runtime "
                    f"applied every instance before it: the nearest, {p['runtime']} (steps {p['start_step']}..{k}), "
                    f"{why}")
    return False


def check_lease_history(events: list[WatchEvent], complete: bool) -> Check:
    """3. No physical device leased to two holders at once (the etcd watch history of the whole run)."""
    bad = check_exclusive_device_leases(events)
    if bad:
        v = bad[0]
        return Check("exclusive-device-leases", False, f"{len(bad)} violations; first at revision {v.revision} on "
                     f"{v.key}: {v.detail}")
    note = "" if complete else " (the history has a gap: the watch was compacted)"
    return Check("exclusive-device-leases", complete, f"{len(events)} lease changes, never two holders{note}")


def check_checkpoints(results: list[tuple[str, int, str | None]]) -> Check:
    """4. Every committed checkpoint restores and matches its checksum: ``(slice, step, error or None)``."""
    bad = [(s, st, e) for s, st, e in results if e]
    if bad:
        s, st, e = bad[0]
        return Check("committed-checkpoints-restore", False, f"{len(bad)} of {len(results)} commits do not restore; "
                     f"first {s}@{st}: {e}")
    return Check("committed-checkpoints-restore", True, f"{len(results)} commits restore with their checksums")


def check_outcome(state: str, reason: str, wall_s: float, *, expect: str, expect_reason: str,
                  time_bound_s: float) -> Check:
    """5. The job finished within the time bound, or failed with the reason the scenario expects."""
    import re

    if state != expect:
        return Check("outcome", False, f"expected {expect}, got {state} after {wall_s:.1f}s"
                     + (f": {reason}" if reason else ""))
    if expect == "failed" and expect_reason and not re.search(expect_reason, reason):
        return Check("outcome", False, f"failed as expected, but the reason {reason!r} does not match "
                     f"{expect_reason!r}")
    if wall_s > time_bound_s:
        return Check("outcome", False, f"{state} after {wall_s:.1f}s, past the bound of {time_bound_s:.0f}s")
    return Check("outcome", True, f"{state} in {wall_s:.1f}s (bound {time_bound_s:.0f}s)"
                 + (f": {reason}" if reason else ""))


def check_suspends(suspends: Sequence[Mapping[str, Any]], leases_left: Sequence[str]) -> Check:
    """6. (Scenarios with ``kind = "suspend"``.) Each suspend ended the job SUSPENDED (its etcd record too) with
    no device lease of the job left, the resume restored the cut the suspend saved, and no lease of the job
    outlived it (``leases_left``: its leases once it ended). ``suspends``: the follower's records, in order."""
    problems: list[str] = []
    said: list[str] = []
    for i, sp in enumerate(suspends, 1):
        what = f"suspend #{i} (asked at step {sp['asked_step']})"
        if sp.get("error"):
            problems.append(f"{what} was refused: {sp['error']}")
        elif sp.get("suspended_at") is None:
            problems.append(f"{what}: the job never ended suspended")
        elif sp.get("record_state") != "suspended":
            problems.append(f"{what}: the job's record says {sp.get('record_state')!r}, not 'suspended'")
        elif sp["leases_held"]:
            problems.append(f"{what}: {len(sp['leases_held'])} device leases still held while suspended: "
                            f"{list(sp['leases_held'])[:4]}")
        elif sp.get("resumed_at") is None:
            problems.append(f"{what}: never resumed")
        elif sp.get("resumed_from") is None or sp["resumed_from"] != sp["cut"]:
            problems.append(f"{what}: saved its cut at step {sp['cut']} but the resume restored "
                            f"{sp.get('resumed_from')}")
        else:
            said.append(f"suspended at step {sp['step']} (cut {sp['cut']}; asked at step {sp['asked_step']}, "
                        f"{sp.get('state_when_asked') or '?'} then), no lease held, resumed "
                        f"{sp['resumed_at'] - sp['suspended_at']:.1f}s later from step {sp['resumed_from']}")
    if not suspends:
        problems.append("the scenario suspends the job but no suspend was asked (the job ended first?)")
    if leases_left:
        problems.append(f"{len(leases_left)} device leases of the job outlived it: {list(leases_left)[:4]}")
    if problems:
        return Check("suspend-resume", False, "; ".join(problems))
    return Check("suspend-resume", True, "; ".join(said) + "; no device lease outlived the job")
