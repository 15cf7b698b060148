"""Invariant checks over what a run left behind: plain data in, violations out.

These functions never talk to etcd; callers record the evidence (watch history,
final state) and pass it in, so the checks are tested on synthetic histories too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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


def check_applied_once(runtimes: list[dict], nodes: dict[str, NodeInfo], *, microbatches: int, steps: int) -> Check:
    """2. Every step applied exactly once per node, from the workers' instance records.

    Per slice, the runtimes that held it form a lineage in load order. Each must
    start at step 0 or at the checkpoint step it restored (anything else skips or
    repeats state updates); none may run an instance twice; and each must run every
    instance of its slice's nodes from its start up to where the next runtime of the
    slice took over (the end of the job for the last). Work a lost runtime did past
    that point was thrown away with it and is not counted.
    """
    problems: list[str] = []
    slices = sorted({i.slice for i in nodes.values()})
    runs_checked = 0
    for s in slices:
        lineage = [r for r in runtimes if s in r.get("slices", ())]
        if not lineage:
            problems.append(f"slice {s}: no runtime recorded any instance")
            continue
        if lineage[0]["start_step"] != 0:
            problems.append(f"slice {s}: the first runtime {lineage[0]['runtime']} started at step "
                            f"{lineage[0]['start_step']}, not 0")
        for i, r in enumerate(lineage):
            runs_checked += 1
            start = int(r["start_step"])
            if start > 0 and r.get("restored_from") != start:
                problems.append(f"slice {s}: runtime {r['runtime']} started at step {start} but restored the "
                                f"checkpoint of step {r.get('restored_from')}: the steps between were not applied")
            mine = [(x["n"], int(x["s"]), int(x["m"])) for x in r["instances"] if x["n"] in nodes
                    and nodes[x["n"]].slice == s]
            seen: set[tuple[str, int, int]] = set()
            for key in mine:
                if key in seen:
                    problems.append(f"slice {s}: runtime {r['runtime']} ran {key[0]} step {key[1]} microbatch "
                                    f"{key[2]} twice")
                seen.add(key)
            stop = int(lineage[i + 1]["start_step"]) if i + 1 < len(lineage) else steps
            want: set[tuple[str, int, int]] = set()
            for n, info in nodes.items():
                if info.slice == s:
                    want |= _instances(n, info, start, stop, microbatches)
            missing = sorted(want - seen, key=lambda k: (k[1], k[0], k[2]))
            if missing:
                shown = ", ".join(f"{n}@{st}/{m}" for n, st, m in missing[:5])
                problems.append(f"slice {s}: runtime {r['runtime']} (steps {start}..{stop}) never ran "
                                f"{len(missing)} instances: {shown}{' ...' if len(missing) > 5 else ''}")
    if problems:
        return Check("applied-exactly-once", False, "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else ""))
    return Check("applied-exactly-once", True, f"{runs_checked} runtimes over {len(slices)} slices: every instance of "
                 f"steps 0..{steps - 1} applied once along each slice's lineage")


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
