"""Recovery settings and records: pure data, checked without processes."""

from __future__ import annotations

import time

import pytest

from rallypoint.client.commands.faults import Fault, parse_faults
from rallypoint.basics.errors import ConfigError
from rallypoint.orchestrator.job.recovery import JobSettings, RecoveryRecord
from rallypoint.proto import rallypoint_pb2 as pb


def test_settings_fill_defaults_and_name_the_bad_field() -> None:
    s = JobSettings.from_spec(pb.JobSpec(job="j"))
    assert (s.policy, s.on_no_spare, s.checkpoint_every, s.keep_checkpoints) == ("partial", "wait", 10, 3)
    assert JobSettings.from_spec(pb.JobSpec(job="j", policy="restart-all", checkpoint_every=4)).checkpoint_every == 4
    with pytest.raises(ValueError, match="recovery policy 'spmd' is not one of"):
        JobSettings.from_spec(pb.JobSpec(job="j", policy="spmd"))
    with pytest.raises(ValueError, match=r"shrink' needs a slice that may run on fewer devices: declare it "
                                         r"prog.slice\(name, devices=\(min, max\)\)"):
        JobSettings.from_spec(pb.JobSpec(job="j", on_no_spare="shrink"))
    variant = pb.NodeProgram(name="n", slice="s", variants=[pb.ExportedVariant(devices=1)])
    assert JobSettings.from_spec(pb.JobSpec(job="j", on_no_spare="shrink", nodes=[variant])).on_no_spare == "shrink"
    with pytest.raises(ValueError, match="checkpoint_every must be >= 0"):
        JobSettings.from_spec(pb.JobSpec(job="j", checkpoint_every=-1))


def test_straggler_settings_fill_defaults_and_name_the_bad_field() -> None:
    s = JobSettings.from_spec(pb.JobSpec(job="j")).stragglers
    assert (s.mode, s.factor, s.window, s.persist) == ("migrate", 2.0, 16, 8)
    s = JobSettings.from_spec(pb.JobSpec(job="j", stragglers="report", straggler_factor=3.0, straggler_window=3))
    assert (s.stragglers.mode, s.stragglers.factor, s.stragglers.window, s.stragglers.persist) == ("report", 3.0, 3, 3)
    with pytest.raises(ValueError, match=r"stragglers 'always' is not one of \['migrate', 'report', 'off'\]"):
        JobSettings.from_spec(pb.JobSpec(job="j", stragglers="always"))
    with pytest.raises(ValueError, match="straggler_factor must be > 1"):
        JobSettings.from_spec(pb.JobSpec(job="j", straggler_factor=0.5))
    with pytest.raises(ValueError, match="straggler_window must be >= 0"):
        JobSettings.from_spec(pb.JobSpec(job="j", straggler_window=-2))
    with pytest.raises(ValueError, match="straggler_persist must be between 1 and straggler_window"):
        JobSettings.from_spec(pb.JobSpec(job="j", straggler_window=3, straggler_persist=5))


def test_a_record_reports_phases_in_order_and_mttr_only_once_replay_ended() -> None:
    now = time.monotonic()
    r = RecoveryRecord(number=1, lost={"w1": ["s"]}, reasons={"w1": "x"}, detected_at=0.0, detected_mono=now,
                       detection_s=0.05)
    r.marks.update({"fencing": now + 0.1, "remap": now + 0.15, "restore": now + 0.45})
    assert r.to_json()["mttr_s"] is None
    assert list(r.phases()) == ["detection", "fencing", "remap", "restore"]
    r.targets, r.generations, r.checkpoint_step = {"n": 10}, {"w9": 3}, 5
    r.expected.update({"n": 2})
    r.observe("w9", 3, "n", 5)
    r.observe("w9", 2, "n", 6)  # an older runtime: not this recovery's replay
    r.observe("w9", 3, "n", 10)  # past where the node had got: not replay
    r.observe("w9", 3, "n", 4)  # below the checkpoint: not replay
    assert not r.replayed
    r.observe("w9", 3, "n", 6)
    assert r.replayed
    r.mark("replay", now + 0.6)
    out = r.to_json()
    assert out["mttr_s"] == pytest.approx(sum(out["phases"][p] for p in ("detection", "fencing", "remap", "restore",
                                                                         "replay")), abs=1e-3)


def test_fail_specs_name_a_slice_or_a_node_and_a_step_inside_the_job() -> None:
    kw = {"slices": ["s0", "s1"], "node_slices": {"fwd": "s1"}, "steps": 10}
    assert parse_faults(["kill:s0@3", "kill:fwd@9"], **kw) == [Fault("s0", "s0", 3), Fault("fwd", "s1", 9)]
    assert parse_faults(["preempt:s0@3", "drain:fwd@4"], **kw) == [Fault("s0", "s0", 3, "preempt"),
                                                                  Fault("fwd", "s1", 4, "drain")]
    with pytest.raises(ConfigError, match="write it as ACTION:NAME@STEP"):
        parse_faults(["stop:s0@3"], **kw)
    with pytest.raises(ConfigError, match="'nope' is neither a slice"):
        parse_faults(["kill:nope@3"], **kw)
    with pytest.raises(ConfigError, match="between 1 and 9"):
        parse_faults(["kill:s0@10"], **kw)


def test_warm_spares_default_on_zero_off_negative_refused_naming_the_field() -> None:
    from rallypoint.recovery.warm import DEFAULT_WARM_SPARES

    assert JobSettings.from_spec(pb.JobSpec(job="j")).warm_spares == DEFAULT_WARM_SPARES > 0
    assert JobSettings.from_spec(pb.JobSpec(job="j", warm_spares=0)).warm_spares == 0
    assert JobSettings.from_spec(pb.JobSpec(job="j", warm_spares=5)).warm_spares == 5
    with pytest.raises(ValueError, match="warm_spares must be >= 0"):
        JobSettings.from_spec(pb.JobSpec(job="j", warm_spares=-1))


def test_a_record_counts_first_calls_of_the_runtime_it_loaded_on_moved_slices_only() -> None:
    rec = RecoveryRecord(number=1, lost={"w1": ["s"]}, reasons={}, detected_at=0.0, detected_mono=0.0, detection_s=0.0,
                         moved={"s": "w9"}, generations={"w9": 4, "w2": 3})
    rec.first_call("w9", 3, "s", "warm", 0.0)  # an older runtime of the worker
    rec.first_call("w2", 3, "t", "compiled", 1.0)  # a slice that did not move
    assert rec.first_calls == {}
    rec.first_call("w9", 4, "s", "warm", 0.0)
    rec.first_call("w9", 4, "s", "warm", 0.25)
    assert rec.to_json()["first_calls"] == {"s": {"source": "warm", "compile_s": 0.25, "nodes": 2}}
    rec.first_call("w9", 4, "s", "compiled", 0.5)
    assert rec.first_calls["s"] == {"source": "mixed", "compile_s": 0.75, "nodes": 3}
