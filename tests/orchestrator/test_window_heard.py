"""The leader narrows the automatic window from every byte a worker's output log holds since the cut, spilled ones
included (a FakeWorkers harness: tests/helpers/executor.py)."""

from __future__ import annotations

import json
from pathlib import Path

from rallypoint.orchestrator.job.window import MIN_WINDOW
from rallypoint.proto import rallypoint_pb2 as pb
from tests.helpers.executor import Harness, pipeline_spec

MIB = 1 << 20


def test_a_log_that_spilled_narrows_the_window_by_all_it_logged_not_only_what_it_keeps_in_memory(
        tmp_path: Path) -> None:
    spec = pipeline_spec(steps=40, checkpoint_every=10, log_limit_bytes=16 * MIB)
    spec.window = 0  # the leader decides
    h = Harness(tmp_path, spec=spec)
    h.x.begin()
    assert h.x.worker_events.window.steps == 10  # one checkpoint interval
    while not h.workers.events.empty():
        h.workers.events.get_nowait()
    w = h.worker_of("s0")
    # After step 0 the log holds 8 MiB: 1 MiB in memory, 7 MiB spilled past its memory limit. 8 MiB a step: the
    # interval alone (10 steps, 80 MiB) is past the 16 MiB limit, so the narrowest window. Counting the memory only
    # (1 MiB a step) left a window of 6 steps, whose logs spill too.
    h.workers.events.put(("done", (w, h.workers.generation[w],
                                   pb.InstanceDone(node="fwd0", step=0, log_bytes=MIB, log_spilled_bytes=7 * MIB))))
    h.x.step(timeout_s=0.0)
    assert h.x.worker_events.window.steps == MIN_WINDOW
    (narrowed,) = [json.loads(e.detail) for e in h.events if e.event == "job.window"]
    assert narrowed["window"] == MIN_WINDOW and "8388608 a step" in narrowed["reason"], narrowed
