"""Rallypoint's public surface: describe a training computation as a graph, run it.

    from rallypoint.client import Program, gather

Users of ``client`` need nothing else; see ``docs/program-api.md``. The names load on
first use (PEP 562), so a CLI command that needs no JAX (``status``, ``workers``,
``cordon``, ...) does not load it.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers see them
    from rallypoint.client.program import Gathered, NodeHandle, Program, ProgramError, Ref, StateRef, gather

__all__ = ["Gathered", "NodeHandle", "Program", "ProgramError", "Ref", "StateRef", "gather"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rallypoint.client import program

        return getattr(program, name)
    raise AttributeError(f"module 'rallypoint.client' has no attribute {name!r}")
