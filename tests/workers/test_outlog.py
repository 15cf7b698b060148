"""The output log: kept until the cut passes, bounded in memory by spilling, sent again in step order."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.runtime.outlog import OutputLog
from rallypoint.workers.runtime.state import NodeProgress, StateVersions


def header(consumer: str, step: int, mb: int = -1, arg: str = "x", leaves: int = 1) -> pb.TransferHeader:
    return pb.TransferHeader(job="j", node="p", output="o", step=step, microbatch=mb, consumer_node=consumer, arg=arg,
                             leaves=leaves)


def value(step: int, n: int = 256) -> list[np.ndarray]:
    return [np.full(n, step, dtype=np.float32)]


def test_entries_for_replaying_consumers_from_a_step_in_step_order_and_trim_drops_below_the_cut() -> None:
    log = OutputLog(1 << 20)
    for step in (3, 1, 2, 0):
        log.put(header("a", step), value(step))
        log.put(header("b", step), value(step))
    got = log.entries(["a"], 1)
    assert [(h.consumer_node, h.step) for h, _ in got] == [("a", 1), ("a", 2), ("a", 3)]
    assert all(np.array_equal(leaves[0], value(h.step)[0]) for h, leaves in got)
    assert log.trim(2) == 4 and log.low == 2
    assert [h.step for h, _ in log.entries(["a", "b"], 0)] == [2, 2, 3, 3]
    log.put(header("a", 1), value(1))  # below the cut: nothing can ask for it
    assert len(log) == 4
    assert log.memory_bytes == 4 * 256 * 4


def test_past_the_limit_the_oldest_values_spill_to_disk_and_read_back_bitwise(tmp_path: Path) -> None:
    log = OutputLog(3 * 1024, spill_dir=tmp_path)
    for step in range(8):
        log.put(header("a", step), value(step))  # 1 KiB each
        assert log.over_limit == (step >= 3)
        log.spill()  # what the sender does once it holds no lock
    assert not log.over_limit
    assert log.memory_bytes <= 3 * 1024 and log.spilled_bytes == 5 * 1024
    assert log.peak_memory_bytes <= 4 * 1024
    got = log.entries(["a"], 0)
    assert [h.step for h, _ in got] == list(range(8))
    for h, leaves in got:
        assert leaves[0].dtype == np.float32 and np.array_equal(leaves[0], value(h.step)[0])
    log.trim(6)
    assert log.spilled_bytes == 0 and log.memory_bytes == 2 * 1024
    log.close()
    assert not any(tmp_path.iterdir()), "spilled files outlived the log"


def test_a_value_logged_again_replaces_the_old_one_and_the_counters_stay_true() -> None:
    log = OutputLog(1 << 20)
    log.put(header("a", 0), value(0))
    log.put(header("a", 0), value(5))
    assert len(log) == 1 and log.memory_bytes == 1024
    assert log.entries(["a"], 0)[0][1][0][0] == 5
    with pytest.raises(ValueError, match="limit must be >= 0"):
        OutputLog(-1)


def test_a_restored_runtime_starts_its_progress_and_state_versions_at_the_checkpoint_step() -> None:
    p = NodeProgress(every=3, microbatches=(0, 1), steps=20, start=10)
    assert p.low == 12 and p.is_started(9, 0) and not p.is_started(12, 0)
    sv = StateVersions("s", producer_every=1, steps=20, readers=[(1, 1)], push_everies=[], start=10)
    sv.add(sv.key(10), ["v10"])
    assert sv.at(10) == ["v10"] and sv.key(10) == 10
    sv.add(11, ["v11"])
    sv.use(10)  # its one read at step 10 spends version 10
    assert sv.at(10) is None


def test_a_pinned_version_is_kept_for_the_checkpoint_after_its_uses_are_spent() -> None:
    sv = StateVersions("s", producer_every=1, steps=20, readers=[], push_everies=[1])
    sv.pin(5)
    for t in range(0, 7):
        sv.add(t + 1, [f"v{t + 1}"])
        sv.use(t + 1)  # pushed once: spent
    assert sv.at(5) == ["v5"], "the version step 5 reads was dropped before its checkpoint"
    assert sv.at(4) is None
    sv.pin(10)
    assert sv.at(5) is None


def test_a_spill_blocked_in_its_file_write_holds_up_no_put_trim_read_or_count(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The file system hangs inside a spill's write: logging, trimming, counting and reading
    # back the values still in memory go on meanwhile (no file work under the log's lock).
    entered, release = threading.Event(), threading.Event()
    real_save = np.save

    def stuck_save(*args: Any, **kwargs: Any) -> None:
        entered.set()
        assert release.wait(30), "the test never let the write go"
        real_save(*args, **kwargs)

    monkeypatch.setattr(np, "save", stuck_save)
    log = OutputLog(1024, spill_dir=tmp_path)
    log.put(header("a", 0), value(0))

    def producer() -> None:
        log.put(header("a", 1), value(1))  # over the limit: step 0 spills
        log.spill()

    spiller = threading.Thread(target=producer, daemon=True)
    spiller.start()
    assert entered.wait(10)
    others = threading.Thread(target=lambda: (log.put(header("b", 2), value(2)), len(log), log.trim(1),
                                              log.entries(["b"], 0)), daemon=True)
    others.start()
    others.join(5)
    blocked = others.is_alive()
    release.set()
    spiller.join(10)
    others.join(10)
    assert not blocked, "a put, trim or read waited for a spill's file write"
    # step 0 was trimmed while it was being written: its file went with it, nothing counts it;
    # the spill went on with step 1 (two values left over a one-value limit)
    assert (log.memory_bytes, log.spilled_bytes, len(log)) == (1024, 1024, 2)
    got = log.entries(["a", "b"], 0)
    assert [h.step for h, _ in got] == [1, 2] and all(np.array_equal(v[0], value(h.step)[0]) for h, v in got)
    assert len(list(tmp_path.rglob("*.npy"))) == 1, "a trimmed entry's spilled file stayed behind"
    log.close()


def test_a_spill_the_file_system_refuses_keeps_the_value_in_memory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    log = OutputLog(0, spill_dir=tmp_path)
    log.put(header("a", 0), value(0))

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", full)
    with pytest.raises(OSError, match="No space"):
        log.spill()
    assert log.memory_bytes == 1024 and log.spilled_bytes == 0 and log.over_limit
    monkeypatch.undo()
    assert log.spill() == 1024 and log.spilled_bytes == 1024
    assert np.array_equal(log.entries(["a"], 0)[0][1][0], value(0)[0])
    log.close()
    assert not any(tmp_path.iterdir())


def test_the_producers_spill_waits_for_a_push_threads_write_in_flight_so_the_bytes_in_memory_keep_the_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A push thread is writing the oldest value out (its file write hangs) when the producer, one value over the
    # limit, relieves the log: the value in flight counts as gone, so nothing is left for the producer to write,
    # but until that write ends the bytes in memory are still over the limit. The producer waits for it (else it
    # would log its next value on top: the log over its bound by two values, as CI once saw).
    entered, release = threading.Event(), threading.Event()
    real_save = np.save

    def save(*args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "push":
            entered.set()
            assert release.wait(30), "the test never let the write go"
        real_save(*args, **kwargs)

    monkeypatch.setattr(np, "save", save)
    log = OutputLog(3 * 1024, spill_dir=tmp_path)
    for step in range(4):  # one value over the limit
        log.put(header("a", step), value(step))
    push = threading.Thread(target=log.spill, kwargs={"down_to": log.low_mark}, name="push", daemon=True)
    push.start()
    assert entered.wait(10)
    producer = threading.Thread(target=log.spill, kwargs={"settle": True}, name="producer", daemon=True)
    producer.start()
    producer.join(0.5)
    waited = producer.is_alive()
    in_memory = log.memory_bytes
    release.set()
    producer.join(10)
    push.join(10)
    assert waited and in_memory == 4 * 1024, "the producer went on while the log held more than its limit"
    assert not producer.is_alive() and log.memory_bytes <= log.low_mark
    assert [h.step for h, _ in log.entries(["a"], 0)] == [0, 1, 2, 3]
    log.close()
