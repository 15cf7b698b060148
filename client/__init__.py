"""Rallypoint's public surface: describe a training computation as a graph, run it.

Everything a job file or a library user needs is imported from here::

    from rallypoint.client import Program, gather, compile_program, submit

* the program: :class:`Program` (``Program.from_step`` for a user's own train step), :func:`gather`,
  :class:`NodeHandle`, :class:`Ref`, :class:`StateRef`, :class:`Gathered`, :class:`ProgramError`;
  :func:`load_program` loads a job file;
* compiling: :func:`compile_program` (every node exported with ``jax.export``) into a :class:`CompiledProgram`;
* running in process: :func:`run_reference` (the reference executor, a :class:`RunResult`) and
  :func:`state_digest`, the digest a cluster's run must match bitwise;
* running on a cluster and following the job: :func:`submit`, :func:`resume`, :class:`JobError`,
  :class:`JobStoppedError`; a job's life from a client that does not stay: :func:`submit_detached`,
  :func:`resume_detached`, :func:`watch`, :func:`control` (cancel, suspend);
* weights out: :func:`load_state` reads a state that ``rallypoint export`` wrote (or a run's committed state
  straight from its run directory) as the job's own tree, NumPy or onto given shardings (docs/checkpoints.md);
* step-indexed data for host sources: :class:`GrainBatches`, :class:`TokenWindows`, :func:`positions`,
  :func:`record_indices`, :func:`epoch_of`, :func:`stack_records`, :class:`DataError`;
* the job's settings, shipped with its code: :func:`setting`, :func:`job_config`.

``docs/program-api.md`` and ``docs/data.md`` document them. The other modules of this package and
``client/commands/`` (the ``rallypoint`` command line) are internals. The names load on first use
(PEP 562), so a CLI command that needs no JAX (``status``, ``workers``, ``cordon``, ...) does not load it.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers see them
    from rallypoint.client.compile import CompiledProgram, compile_program
    from rallypoint.client.data import (DataError, GrainBatches, TokenWindows, epoch_of, positions, record_indices,
                                        stack_records)
    from rallypoint.client.jobfile import load_program
    from rallypoint.client.lifecycle import control, resume_detached, submit_detached, watch
    from rallypoint.client.program import Gathered, NodeHandle, Program, ProgramError, Ref, StateRef, gather
    from rallypoint.client.reference import RunResult, run_reference, state_digest
    from rallypoint.client.submission import JobError, JobStoppedError, resume, submit
    from rallypoint.client.settings import job_config, setting
    from rallypoint.client.weights import load_state

_HOMES = {
    "program": ("Gathered", "NodeHandle", "Program", "ProgramError", "Ref", "StateRef", "gather"),
    "jobfile": ("load_program",),
    "compile": ("CompiledProgram", "compile_program"),
    "reference": ("RunResult", "run_reference", "state_digest"),
    "submission": ("JobError", "JobStoppedError", "resume", "submit"),
    "lifecycle": ("control", "resume_detached", "submit_detached", "watch"),
    "settings": ("job_config", "setting"),
    "weights": ("load_state",),
    "data": ("DataError", "GrainBatches", "TokenWindows", "epoch_of", "positions", "record_indices", "stack_records"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_HOME_OF)


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'rallypoint.client' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"rallypoint.client.{module}"), name)
