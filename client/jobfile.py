"""Loading a job file: a Python file that builds a :class:`~rallypoint.client.program.Program`.

A job file assigns its program to ``program`` at module level, or defines
``build()`` returning one. Any failure is a :class:`ProgramError` naming the file.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path

from rallypoint.basics.settings import recording
from rallypoint.client.program import Program, ProgramError


def load_program(path: str | Path, *, steps: int | None = None, settings: Mapping[str, str] | None = None) -> Program:
    """Import ``path`` and return its program, with ``steps`` overriding its step count.

    ``settings``: the job's settings given at submit (``--set NAME=VALUE``), which
    :func:`rallypoint.client.setting` returns while the file loads; the program's ``settings`` are
    those and every other one the file read (docs/data.md, "Job settings")."""
    p = Path(path)
    if not p.is_file():
        raise ProgramError(f"job file {str(path)!r} not found")
    if steps is not None and steps < 1:
        raise ProgramError(f"--steps must be a positive integer, got {steps}")
    spec = importlib.util.spec_from_file_location(f"rallypoint_job_{p.stem.replace('-', '_')}", p)
    if spec is None or spec.loader is None:
        raise ProgramError(f"job file {str(path)!r} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    job_dir = str(p.resolve().parent)
    sys.path.insert(0, job_dir)
    with recording(settings) as shipped:
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # user code: report it against the file
            raise ProgramError(f"job file {str(path)!r} failed to import: {type(exc).__name__}: {exc}") from exc
        finally:
            if job_dir in sys.path:
                sys.path.remove(job_dir)
        program = getattr(module, "program", None)
        if program is None and callable(getattr(module, "build", None)):
            program = module.build()
    if not isinstance(program, Program):
        raise ProgramError(
            f"job file {str(path)!r} defines no Program: assign one to `program` at module level "
            "(or define build() returning one)"
        )
    if steps is not None:
        program.steps = steps
    program.settings = {**program.settings, **shipped}
    return program
