"""The client's error type, in a module of its own so that every client module may raise it
(:mod:`rallypoint.client.program` re-exports it, and the modules its methods call cannot import that
module back without an import cycle)."""

from __future__ import annotations

from rallypoint.basics.errors import RallypointError


class ProgramError(RallypointError):
    """A program is invalid; the message names the node, edge, slice or state."""
