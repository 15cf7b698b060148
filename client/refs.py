"""The parts of a :class:`~rallypoint.client.program.Program`'s graph: its nodes and their edges.

An edge, what a node's input reads: a node output (:class:`Ref`), a state as at the start of the
step (:class:`StateRef`), or a per-microbatch output of every microbatch of the step, stacked
(:class:`Gathered`, made by :func:`rallypoint.client.program.gather`). A node, as
:meth:`Program.node <rallypoint.client.program.Program.node>` declares it: :class:`NodeSpec`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from jax.sharding import PartitionSpec

Per = Literal["step", "microbatch"]


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


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A block of work on one slice.

    ``fn(**inputs)`` returns a dict with exactly ``outputs`` as keys (a single
    output may also be returned bare). A source is a node whose inputs are the
    step and microbatch numbers (int32 scalars): ``fn(step, microbatch)``.
    """

    name: str
    fn: Callable[..., Any]
    slice: str
    inputs: Mapping[str, Input]
    outputs: tuple[str, ...]
    per: Per
    updates: Mapping[str, str]  # output name -> state name
    every: int
    shardings: Mapping[str, PartitionSpec]
    is_source: bool = False
    host: bool = False  # a host source: plain Python run on the worker (docs/data.md)
    prefetch: int = 0  # a host source: instances read ahead (0: the default)
    origin: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)  # a host source: the
    # globals of the job's module that declared it (the worker imports ``fn`` from there by name)
    clock: bool = False  # a source given the step itself, never a skip's stream position (recovery/skips.py)
