"""How a slice's group reads its members' answers: the requests sent and not yet answered, a call's answer, and
which member a loss is blamed on (:class:`~rallypoint.workers.gang.group.SliceGroup`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class Sent:
    """A request every member was sent, and, once read, their answers (in member order); ``error``: a member's
    refusal, kept for whoever waits for it (a :class:`~rallypoint.workers.gang.group.GroupError`)."""

    __slots__ = ("what", "deadline", "ahead", "answers", "error")

    def __init__(self, what: str, deadline: float, ahead: bool) -> None:
        self.what, self.deadline, self.ahead = what, deadline, ahead
        self.answers: list[tuple[dict[str, Any], list[bytes]]] | None = None
        self.error: Exception | None = None


def request_name(header: dict[str, Any]) -> str:
    """What a request is, as errors name it."""
    if "value" in header:
        return f"value {header['value']!r}"
    return f"{header['op']!r} of program {header['prog']!r}" if "prog" in header else repr(header["op"])


def call_answer(answer: tuple[dict[str, Any], list[bytes]],
                ) -> tuple[list[tuple[str, tuple[int, ...]]], dict[int, np.ndarray]]:
    """A call's outputs' dtypes and shapes, and its scalar outputs' values by index (member 0's answer)."""
    h, data = answer
    avals = [(d, tuple(s)) for d, s in h["avals"]]
    scalars = {int(i): np.frombuffer(b, dtype=np.dtype(avals[int(i)][0])).reshape(()).copy()
               for i, b in zip(h.get("scalars", ()), data, strict=True)}
    return avals, scalars


ABORTED = "SIGABRT"
"""How JAX's coordination service ends a member whose group lost another one (docs/multihost.md)."""


def blame(members: Sequence[Any], found: int, reason: str) -> tuple[int, str] | None:
    """The member to name for a loss found at member ``found`` (gone for ``reason``), when that one was only
    aborted by JAX because another went first: the first other member gone for a reason of its own, with it;
    None to keep ``found``. Members answer in order, so the first one read may be the one JAX aborted."""
    if ABORTED not in reason:
        return None
    for m in members:
        why = m.gone() if m.index != found else ""
        if why and ABORTED not in why:
            return m.index, why
    return None
