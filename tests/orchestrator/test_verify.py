"""A verification's decisions without a cluster (orchestrator/job/verify.py): which slices can be verified alone,
how a match extends the trusted cuts, and who the odd one out is after a mismatch. On a real cluster, with a
worker that corrupts its state: tests/integration/test_verify.py."""

from __future__ import annotations

from typing import Any

from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.orchestrator.job.verify import Check, JobVerifier, closed_slices
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.skips import Skips

B = pb.InputBinding


def pipeline() -> pb.JobSpec:
    """a (states, reads its own source) -> b (states, reads a's output); g: a gang slice with states."""
    return pb.JobSpec(job="j", steps=4, slices=[pb.SliceAssignment(slice="a"), pb.SliceAssignment(slice="b"),
                                                pb.SliceAssignment(slice="g", members=[pb.GangMember()])],
                      nodes=[pb.NodeProgram(name="src", slice="a", inputs=[B(arg="step", kind=B.STEP)]),
                             pb.NodeProgram(name="fa", slice="a", inputs=[B(arg="x", kind=B.REF, node="src"),
                                                                          B(arg="w", kind=B.STATE, state="wa")]),
                             pb.NodeProgram(name="fb", slice="b", inputs=[B(arg="x", kind=B.REF, node="fa"),
                                                                          B(arg="w", kind=B.STATE, state="wb")]),
                             pb.NodeProgram(name="fg", slice="g", inputs=[B(arg="w", kind=B.STATE, state="wg")])],
                      states=[pb.StateProgram(name="wa", slice="a"), pb.StateProgram(name="wb", slice="b"),
                              pb.StateProgram(name="wg", slice="g")])


def test_only_a_slice_that_reads_its_own_outputs_and_states_and_runs_on_one_worker_is_verified() -> None:
    assert closed_slices(pipeline()) == ["a"]


class _Events:
    def __init__(self) -> None:
        self.got: list[tuple[str, int, dict[str, Any]]] = []

    def __call__(self, name: str, step: int = 0, **detail: Any) -> None:
        self.got.append((name, step, detail))


def verifier(events: _Events) -> JobVerifier:
    v = JobVerifier(pipeline(), cluster="c", tls=None, term=None, placement=dict, skips=Skips,
                    cluster_now=lambda: None, deterministic=lambda: True, event=events,  # type: ignore[arg-type]
                    log=_Log())
    v.configure(1, 0, None, 2, 0)
    v.trusted = {"a": {0}}
    return v


class _Log:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def check(number: int, start: int, step: int, verifier: str, checksum: str, *, first: Check | None = None) -> Check:
    c = Check(number, "a", start, step, "w0", verifier, CheckpointCommit("j", "a", step, f"/r/a/w/{step}", "P"),
              None, 1, first)
    c.result = pb.VerifiedState(slice="a", step=step, checksum=checksum, match=checksum == "P")
    return c


def test_a_match_from_a_trusted_cut_makes_its_cut_trusted_and_one_from_an_untrusted_cut_does_not() -> None:
    events = _Events()
    v = verifier(events)
    v.done.put(check(1, 0, 2, "w1", "P"))
    assert v.poll() is None and v.trusted["a"] == {0, 2} and v.verified == 1
    v.done.put(check(2, 4, 6, "w1", "P"))
    assert v.poll() is None and v.trusted["a"] == {0, 2} and v.verified == 2
    assert [name for name, _, _ in events.got] == ["job.verified", "job.verified"]
    v.forget_from(0)
    assert v.trusted["a"] == {0}


def test_after_a_mismatch_the_third_worker_names_the_odd_one_out() -> None:
    v = verifier(_Events())
    v.trusted["a"] = {0, 2}
    first = check(1, 2, 4, "w1", "V")
    got = v._adjudicated(first, check(2, 2, 4, "w2", "V", first=first))  # the third agrees with the verifier
    assert got is not None and (got.worker, got.primary, got.trusted) == ("w0", True, 2)
    got = v._adjudicated(first, check(3, 2, 4, "w2", "P", first=first))  # ... with the primary
    assert got is not None and (got.worker, got.primary) == ("w1", False)
    assert v._adjudicated(first, check(4, 2, 4, "w2", "X", first=first)) is None  # three answers: not deterministic
    assert [m["verdict"] for m in v.mismatches] == ["convicted", "convicted", "inconclusive"]
    assert v.to_json()["mismatched"] == 3 and v.to_json()["convicted"] == 2


class _Term:
    """The commits of slice ``a`` every 10 steps up to 100 (what ``JobTerm.commits`` reads)."""

    def commits(self) -> dict[str, list[CheckpointCommit]]:
        return {"a": [CheckpointCommit("j", "a", c, f"/r/a/w/{c}", f"C{c}") for c in range(10, 101, 10)]}


def test_a_budget_starts_a_verification_only_while_the_steps_run_again_stay_within_its_fraction() -> None:
    v = verifier(_Events())
    v.configure(0, 0, None, 10, 0, fraction=0.1)
    v.every, v.term, v.trusted = 1, _Term(), {"a": {0}}
    started: list[tuple[int, int]] = []
    v._start = lambda s, start, step, *a, **k: started.append((start, step)) or True  # type: ignore[method-assign]
    for cut in range(10, 101, 10):
        v._verify("a", cut, budgeted=True)
    # 3 slices ran `cut` steps each: 0.1 of that is 0.3 x cut slice-steps; each verification re-runs 10.
    assert started == [(30, 40), (60, 70), (90, 100)] and v.spent == 30  # 30 <= 0.3 x 100
    assert v._verify("a", 100) and len(started) == 4 and v.spent == 30  # the end's is not counted


def test_a_resumed_run_keeps_the_trusted_cuts_and_counts_its_record_holds_and_refuses_the_malformed() -> None:
    v = verifier(_Events())
    v.trusted = {"a": {0, 20, 40}}
    v.verified, v.spent = 3, 30
    record = v.to_json()
    fresh = verifier(_Events())
    fresh.adopt(record)
    assert fresh.trusted == {"a": {0, 20, 40}} and fresh.verified == 3 and fresh.spent == 30
    odd = verifier(_Events())
    odd.adopt({"trusted": {"a": [10, -1, True, "x"], "zz": [5]}, "verified": -2, "mismatches": ["x", {"verdict": "y"}]})
    assert odd.trusted == {"a": {0, 10}} and odd.verified == 0 and odd.mismatches == [{"verdict": "y"}]
    odd.adopt(None)
    assert odd.trusted == {"a": {0, 10}}


def test_a_verification_runs_only_on_an_idle_worker_of_the_primarys_platform_and_kind_with_deterministic_kernels(
) -> None:
    from rallypoint.etcd.cluster_records import ClusterSnapshot, Holder, WorkerInfo, WorkerSnapshot
    from rallypoint.recovery.load_plan import SlicePlace

    def worker(w: str, *, kind: str = "H100", platform: str = "cuda", deterministic: bool = True,
               held: bool = False, cordoned: bool = False) -> WorkerSnapshot:
        info = WorkerInfo(w, 1, 1, f"{w}:1", 1, 1, "ready", {}, platform=platform, device_kind=kind,
                          deterministic=deterministic)
        return WorkerSnapshot(info, (0,), {0: Holder("other", "s", "n1")} if held else {}, cordoned)

    pool = {"w0": worker("w0"), "a": worker("a", kind="A100"), "b": worker("b", platform="cpu"),
            "c": worker("c", deterministic=False), "d": worker("d", held=True), "e": worker("e", cordoned=True),
            "f": worker("f")}
    v = verifier(_Events())
    v.cluster_now = lambda: ClusterSnapshot(1, pool, frozenset({"e"}))  # type: ignore[method-assign]
    v.placement = lambda: {"a-slice": SlicePlace("w0", "w0:1", 1, (0,))}  # type: ignore[method-assign]
    assert v._spare(1, set(), like="w0").info.worker == "f"
    assert v._spare(1, {"f"}, like="w0") is None
