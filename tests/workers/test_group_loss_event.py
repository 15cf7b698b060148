"""A multi-host slice's lost member reaches the leader as a field of the failed instance, not as text."""

from __future__ import annotations

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.gang.group import GroupLost
from rallypoint.workers.runtime.control import JobControl
from rallypoint.workers.runtime.outlog import OutputLog


def _control() -> JobControl:
    return JobControl("j", cluster="c", worker_id="lead", admit=lambda to: None, incarnation=lambda: 1,
                      outlog=OutputLog(1 << 20))


def test_an_instance_failed_by_a_lost_member_names_the_members_worker() -> None:
    control = _control()
    events = control.events.subscribe()
    lost = GroupLost(1, "on worker w7: its call ended", worker="w7")
    with control.cv:  # as the slice thread calls it
        control.fail_instance("fwd", 3, 0, 0.5, f"{type(lost).__name__}: {lost}", lost)
    ev = events.get(timeout=1)
    assert ev.HasField("group_lost") and ev.group_lost.member_worker == "w7"
    assert ev.node == "fwd" and ev.step == 3 and "GroupLost" in ev.error


def test_an_error_whose_text_mentions_a_group_loss_is_no_group_loss() -> None:
    # user code that raises with such words is the job's failure, not a lost slice (the leader used to parse text)
    control = _control()
    events = control.events.subscribe()
    user = RuntimeError("GroupLost: member 1 of the slice's group is lost: on worker w7: nope")
    with control.cv:
        control.fail_instance("fwd", 3, 0, 0.5, f"{type(user).__name__}: {user}", user)
    ev = events.get(timeout=1)
    assert not ev.HasField("group_lost") and isinstance(ev, pb.InstanceDone)
