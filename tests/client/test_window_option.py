"""The client's ``window``: 0 (the default) leaves it to the leader; a count of steps is sent as it is."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from rallypoint.client import Program
from rallypoint.client.compile import compile_program
from rallypoint.client.jobspec import job_spec
from rallypoint.client.program import ProgramError


def test_the_window_defaults_to_the_leaders_and_a_bad_one_is_refused_saying_what_to_give() -> None:
    prog = Program("w", steps=4)
    s = prog.slice("only", devices=1)
    total = prog.state("total", slice=s, init=lambda: jnp.zeros((2,)))
    prog.node("add", lambda total: {"total": total + 1}, slice=s, inputs={"total": total}, outputs=("total",),
              updates={"total": total})
    compiled = compile_program(prog)
    assert job_spec(compiled).window == 0 and job_spec(compiled, window=5).window == 5
    for bad in (-1, 1.5, True):
        with pytest.raises(ProgramError, match="an int >= 1, or 0 for the leader to decide it"):
            job_spec(compiled, window=bad)  # type: ignore[arg-type]
