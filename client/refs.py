"""The edges of a :class:`~rallypoint.client.program.Program`: what a node's input reads.

A node output (:class:`Ref`), a state as at the start of the step (:class:`StateRef`), or a
per-microbatch output of every microbatch of the step, stacked (:class:`Gathered`, made by
:func:`rallypoint.client.program.gather`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Ref:
    """An edge source: output ``output`` of node ``node``."""

    node: str
    output: str

    def __str__(self) -> str:
        return f"{self.node}.{self.output}"


@dataclass(frozen=True, slots=True)
class StateRef:
    """A loop-carried value: read at the start of a step, produced for the next one."""

    name: str
    slice: str

    def __str__(self) -> str:
        return f"state {self.name}"


@dataclass(frozen=True, slots=True)
class Gathered:
    """The per-microbatch value ``ref`` of every microbatch of a step, stacked on axis 0."""

    ref: Ref

    def __str__(self) -> str:
        return f"gather({self.ref})"


Input = Ref | StateRef | Gathered
