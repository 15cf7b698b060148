"""The service's stand-in executor (tests/fakes_service.py) stays what the service can call on a real one:
every :class:`JobHandle` method, with the same parameters, on the stand-in and on :class:`JobExecutor`, and
a constructor that takes nothing the real executor does not. A stand-in that drifted would let the service's
unit tests pass against calls the real executor refuses (or miss ones it added)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from rallypoint.orchestrator.job.executor import JobExecutor
from rallypoint.orchestrator.job.view import JobHandle, JobView
from rallypoint.proto import rallypoint_pb2 as pb
from tests.fakes_service import StandInExecutor, service_with_stand_ins


def handle_methods() -> list[str]:
    return sorted(n for n, v in vars(JobHandle).items() if callable(v) and not n.startswith("_"))


def shape(fn: Any) -> list[tuple[str, Any, str]]:
    """A method's parameters as (name, kind, annotation) and its return annotation, ``self`` left out."""
    sig = inspect.signature(fn)
    params = [(p.name, p.kind, str(p.annotation)) for p in sig.parameters.values() if p.name != "self"]
    return [*params, ("return", None, str(sig.return_annotation))]


def test_the_handle_lists_what_the_service_calls() -> None:
    assert handle_methods() == ["request_stop", "run", "stop", "view", "worker_fenced"]


@pytest.mark.parametrize("impl", [StandInExecutor, JobExecutor], ids=["stand-in", "executor"])
def test_each_executor_has_every_handle_method_with_its_parameters(impl: type) -> None:
    for name in handle_methods():
        assert callable(getattr(impl, name, None)), f"{impl.__name__} has no {name}()"
        want, got = shape(getattr(JobHandle, name)), shape(getattr(impl, name))
        if name == "run":  # what run() returns is the executor's own (the service ignores it)
            want, got = want[:-1], got[:-1]
        assert got == want, f"{impl.__name__}.{name}{inspect.signature(getattr(impl, name))} drifted from JobHandle"


def test_the_stand_in_is_built_as_the_executor_is() -> None:
    real = inspect.signature(JobExecutor.__init__).parameters
    stand_in = inspect.signature(StandInExecutor.__init__).parameters
    for name, p in stand_in.items():
        assert name in real, f"the stand-in takes {name!r}, which JobExecutor does not"
        assert p.kind == real[name].kind, f"{name!r}: {p.kind} in the stand-in, {real[name].kind} in JobExecutor"
    required = [n for n, p in real.items() if p.default is inspect.Parameter.empty and n != "self"]
    assert [n for n in required if n not in stand_in] == [], "JobExecutor requires what the stand-in does not take"


def test_a_stand_in_made_by_the_service_is_a_handle_and_its_view_a_job_view(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    svc, _c = service_with_stand_ins(monkeypatch, tmp_path)
    run = svc.start_resumed(pb.JobSpec(job="a", steps=2), checkpoint_root=str(tmp_path), auto=True)
    try:
        (x,) = StandInExecutor.made
        assert run.executor is x and isinstance(x, JobHandle)
        v = x.view()
        assert isinstance(v, JobView) and v.job == "a" and v.steps == 2 and v.auto_resumed and v.resumed
    finally:
        StandInExecutor.made[0].go.set()
        run.done.wait(5)
