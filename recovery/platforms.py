"""Which platforms a job's programs run on, and whether the pool offers one: pure, no JAX.

The client lowers every exported program for a list of platforms (``jax.export``'s names:
``cpu``, ``cuda``, ``rocm``, ``tpu``) and records them in the job spec
(``NodeProgram.platforms``, ``StateProgram.platforms``); each worker records the platform
of its devices in its etcd record (docs/keys.md). At submit the coordinator refuses a job
with a slice whose programs no worker of the pool can run (:func:`platform_refusal`), before
anything is written (docs/platforms.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rallypoint.etcd.cluster_records import ClusterSnapshot
from rallypoint.proto import rallypoint_pb2 as pb

UNRECORDED_WORKER_PLATFORM = "cpu"
"""The platform of a worker whose record names none (a worker from before platforms were recorded ran on CPU)."""


def slice_platforms(spec: pb.JobSpec) -> dict[str, tuple[str, ...] | None]:
    """Per slice of ``spec``: the platforms every one of its programs (nodes and state inits) was
    lowered for, in the order the first program lists them; None where no program of the slice
    records its platforms (a spec from before they were recorded: not checked)."""
    programs: dict[str, list[tuple[str, ...]]] = {s.slice: [] for s in spec.slices}
    for n in spec.nodes:
        if n.platforms:
            programs.setdefault(n.slice, []).append(tuple(n.platforms))
    for st in spec.states:
        if st.platforms:
            programs.setdefault(st.slice, []).append(tuple(st.platforms))
    out: dict[str, tuple[str, ...] | None] = {}
    for name, lists in programs.items():
        if not lists:
            out[name] = None
            continue
        common = set(lists[0]).intersection(*map(set, lists[1:]))
        out[name] = tuple(p for p in lists[0] if p in common)
    return out


def pool_platforms(snapshot: ClusterSnapshot) -> dict[str, list[str]]:
    """The platforms the pool offers: platform -> its live workers that are not leaving, sorted."""
    offered: dict[str, list[str]] = {}
    for w, ws in sorted(snapshot.workers.items()):
        if ws.info.state == "leaving":
            continue
        offered.setdefault(ws.info.platform or UNRECORDED_WORKER_PLATFORM, []).append(w)
    return offered


def platform_refusal(spec: pb.JobSpec, offered: Mapping[str, Iterable[str]]) -> str | None:
    """Why no worker of the pool can run some slice of ``spec`` (one line naming the slice, the
    platforms its programs were lowered for and those on offer), or None when every slice can run.

    ``offered``: platform -> workers (:func:`pool_platforms`). An empty pool refuses nothing
    (placement waits for workers, as it always has), nor does a slice whose programs record no
    platforms.
    """
    have = {p: sorted(ws) for p, ws in offered.items() if ws}
    if not have:
        return None
    bad = [(s, ps) for s, ps in slice_platforms(spec).items() if ps is not None and not set(ps) & set(have)]
    if not bad:
        return None
    on_offer = "; ".join(f"{p} ({', '.join(ws)})" for p, ws in sorted(have.items()))
    slices = "; ".join(f"slice {s!r} has programs lowered for {', '.join(ps) or 'no platform'}" for s, ps in bad)
    return (f"{slices}, and no worker of the pool runs them: the pool offers {on_offer}. Export the job for "
            f"the pool's platforms (`rallypoint run --platform {','.join(sorted(have))}`, or "
            f"compile_program(program, platforms=[...]))")
