"""A Member call's settings, checked by the worker before it starts a member process, and the protocol's frames
read back from chunks of any size (pure logic; the calls themselves are tests/integration/test_multihost_members.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rallypoint.workers.gang.member import encode_frame
from rallypoint.workers.gang.link import FrameParser, MemberPool, MemberRefused, member_settings


def test_a_member_gets_this_workers_host_and_platform_and_member_0_a_coordinator_port_here() -> None:
    zero = member_settings(json.dumps({"processes": 2, "process": 0, "local_devices": 4}), "127.0.0.1", "cuda")
    assert zero.address == "127.0.0.1" and zero.platform == "cuda" and zero.local_devices == 4
    assert zero.coordinator.startswith("127.0.0.1:") and int(zero.coordinator.rsplit(":", 1)[1]) > 0
    one = member_settings(json.dumps({"processes": 2, "process": 1, "local_devices": 2, "coordinator": "h:1",
                                      "platform": "cpu"}), "10.0.0.8", "cuda")
    assert (one.coordinator, one.address, one.platform, one.process) == ("h:1", "10.0.0.8", "cpu", 1)
    # the worker's leased devices, the only ones an accelerator's member uses, reach the member process
    two = member_settings(json.dumps({"processes": 2, "process": 1, "local_devices": 2, "coordinator": "h:1",
                                      "device_ids": [6, 7]}), "10.0.0.8", "cuda")
    assert two.device_ids == (6, 7) and json.loads(two.argv()[-1])["device_ids"] == [6, 7]
    # the worker's TLS paths (its members push their shards' copies with them) and compilation cache come from the
    # worker, never from the driver
    three = member_settings(json.dumps({"processes": 2, "process": 0, "local_devices": 1}), "127.0.0.1", "cpu",
                            ("ca.crt", "w.crt", "w.key"), "/cache")
    assert json.loads(three.argv()[-1])["tls"] == ["ca.crt", "w.crt", "w.key"] and three.compile_cache == "/cache"
    for key in ("tls", "compile_cache"):
        with pytest.raises(MemberRefused, match=f"unknown member settings \\['{key}'\\]"):
            member_settings(json.dumps({"processes": 2, "process": 0, "local_devices": 1, key: "x"}), "127.0.0.1")


@pytest.mark.parametrize(("given", "says"), [
    ("not json", "not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"processes": 2, "process": 0, "local_devices": 1, "shell": "rm"}', "unknown member settings ['shell']"),
    ('{"processes": 2, "process": 0}', "['local_devices'] are missing"),
    ('{"processes": 2, "process": "0", "local_devices": 1}', "'process' must be int"),
    ('{"processes": 2, "process": 2, "local_devices": 1}', "member 2 of a group of 2"),
    ('{"processes": 2, "process": 0, "local_devices": 0}', "at least one local device"),
    ('{"processes": 2, "process": 1, "local_devices": 1}', "must be told the group's coordinator"),
    ('{"processes": 2, "process": 0, "local_devices": 2, "device_ids": [3]}', "must list 2 distinct device"),
    ('{"processes": 2, "process": 0, "local_devices": 2, "device_ids": [3, 3]}', "must list 2 distinct device"),
    ('{"processes": 2, "process": 0, "local_devices": 1, "device_ids": [-1]}', "must list 1 distinct device"),
    ('{"processes": 2, "process": 0, "local_devices": 1, "device_ids": 3}', "'device_ids' must be list"),
])
def test_settings_that_are_not_a_members_are_refused_by_name(given: str, says: str) -> None:
    with pytest.raises(MemberRefused, match=r".*" + __import__("re").escape(says)):
        member_settings(given, "127.0.0.1")


def test_frames_come_back_whole_from_chunks_of_any_size() -> None:
    a = np.arange(10, dtype=np.float32)
    data = b"".join(bytes(p) for p in encode_frame({"op": "put", "value": "x"}, [a, np.zeros((), np.int32)]))
    data += b"".join(bytes(p) for p in encode_frame({"op": "exit"}))
    for size in (1, 3, 7, len(data)):
        parser, frames = FrameParser(), []
        for i in range(0, len(data), size):
            frames += parser.feed(data[i:i + size])
        assert [h["op"] for h, _ in frames] == ["put", "exit"]
        (h, payloads), (h2, p2) = frames
        assert h["sizes"] == [40, 4] and np.array_equal(np.frombuffer(payloads[0], np.float32), a) and p2 == []


def test_a_header_line_past_the_limit_is_refused_not_read_into_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # A member reads its requests (and a driver its answers) a header line at a time: a stream without newlines
    # (/dev/zero piped in by mistake grew one past 2 GB here) is refused at the limit.
    import io

    from rallypoint.workers.gang import member as group_member

    monkeypatch.setattr(group_member, "MAX_HEADER", 1024)
    with pytest.raises(ValueError, match="runs past 1024 bytes"):
        group_member.read_frame(io.BytesIO(b"\0" * 5000))
    frame = b"".join(bytes(p) for p in encode_frame({"op": "x"}, [np.arange(3, dtype=np.int8)]))
    assert group_member.read_frame(io.BytesIO(frame)) == ({"op": "x", "sizes": [3]}, [b"\x00\x01\x02"])


@pytest.mark.processes
def test_a_warm_spare_keeps_the_members_a_job_asks_for_started_beside_the_pools_own_and_ends_them_after() -> None:
    pool = MemberPool(0)
    try:
        pool.hold("job-a", 1, "cpu")
        pool.hold("job-b", 1, "cpu")
        idle = list(pool._idle["cpu"])
        assert len(idle) == 2 and all(p.poll() is None for p in idle)
        pool.hold("job-a", 0, "cpu")  # job-a's plan no longer asks: one is ended, job-b's stays
        assert pool.target == 1 and len(pool._idle["cpu"]) == 1
        assert sum(p.poll() is not None for p in idle) == 1
    finally:
        pool.close()
    assert all(p.poll() is not None for p in idle)

