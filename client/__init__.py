"""Rallypoint's public surface: describe a training computation as a graph, run it.

    from rallypoint.client import Program, gather

Users of ``client`` need nothing else; see ``docs/program-api.md``.
"""

from rallypoint.client.program import Gathered, NodeHandle, Program, ProgramError, Ref, StateRef, gather

__all__ = ["Gathered", "NodeHandle", "Program", "ProgramError", "Ref", "StateRef", "gather"]
