"""What a failed final fetch amounts to (orchestrator/job/finish.py ``final_losses``, pure): a gang's lead that
answers that a member was lost names a loss to recover, not a refusal that fails the job."""

from __future__ import annotations

import grpc
import pytest

from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.orchestrator.job.finish import final_losses
from rallypoint.orchestrator.job.state import JobFailed
from rallypoint.proto.errors import MemberLost, member_lost_metadata

GANGS = {"w0": ["w1"]}  # one multi-host slice: led on w0, its member 1 on w1
NOTHING_GONE: tuple[dict[str, str], frozenset[str]] = ({}, frozenset())


def group_lost(lead: str, member_worker: str, error: str) -> tuple[dict[str, str], frozenset[str]]:
    """``JobPlacement.group_lost`` for :data:`GANGS`: the lead (alive), and the member's worker if it is one."""
    named = [member_worker] if member_worker in GANGS.get(lead, []) else []
    return {lead: f"its multi-host slice lost a member: {error}", **{w: "a lost member" for w in named}}, \
        frozenset({lead})


def member_lost_answer(member_worker: str) -> WorkerCallFailed:
    """The lead's answer to FetchState when a member of its slice was lost meanwhile (workers/runtime/service.py)."""
    error = f"member 1 of the slice's group is lost: on worker {member_worker}: Stream removed"
    return WorkerCallFailed("w0", "FetchState", grpc.StatusCode.ABORTED, f"job 'mh': fetching its final state: {error}",
                            member_lost_metadata(member_worker, error))


def test_a_leads_fetch_failing_because_member_w1_is_lost_is_w1s_loss_with_its_lead_alive() -> None:
    failed = member_lost_answer("w1")
    assert isinstance(failed.member_lost, MemberLost) and failed.member_lost.worker == "w1", failed.member_lost
    losses = final_losses({"w0": failed}, NOTHING_GONE, group_lost)
    assert set(losses.lost) == {"w0", "w1"} and losses.alive == frozenset({"w0"}), losses
    assert "Stream removed" in losses.lost["w0"]


def test_the_same_failure_untyped_is_a_refusal_that_fails_the_job() -> None:
    failed = WorkerCallFailed("w0", "FetchState", grpc.StatusCode.UNKNOWN,
                              "Exception iterating responses: member 1 of the slice's group is lost: on worker w1")
    assert failed.member_lost is None
    with pytest.raises(JobFailed, match="could not fetch the final state"):
        final_losses({"w0": failed}, NOTHING_GONE, group_lost)


def test_a_member_whose_registration_is_gone_is_lost_whatever_the_lead_answered() -> None:
    failed = WorkerCallFailed("w0", "FetchState", grpc.StatusCode.UNKNOWN, "Exception iterating responses")
    gone = ({"w1": "its etcd registration is gone", "w0": "member w1 of multi-host slice 'dp' lost"},
            frozenset({"w0"}))  # as JobPlacement.as_lead_losses gives it
    losses = final_losses({"w0": failed}, gone, group_lost)
    assert set(losses.lost) == {"w0", "w1"} and losses.alive == frozenset({"w0"}), losses


def test_a_lead_whose_own_process_is_gone_is_not_unloaded_as_alive() -> None:
    dead = WorkerCallFailed("w0", "FetchState", grpc.StatusCode.UNAVAILABLE, "Socket closed")
    gone = ({"w1": "its etcd registration is gone", "w0": "member w1 of multi-host slice 'dp' lost"},
            frozenset({"w0"}))
    losses = final_losses({"w0": dead}, gone, group_lost)
    assert set(losses.lost) == {"w0", "w1"} and losses.alive == frozenset(), losses


def test_a_worker_lost_outright_is_lost_and_not_alive() -> None:
    dead = WorkerCallFailed("w2", "FetchState", grpc.StatusCode.UNAVAILABLE, "Socket closed")
    losses = final_losses({"w2": dead, "w0": member_lost_answer("w1")}, NOTHING_GONE, group_lost)
    assert set(losses.lost) == {"w0", "w1", "w2"} and losses.alive == frozenset({"w0"}), losses
