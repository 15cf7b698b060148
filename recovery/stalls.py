"""Who a stalled job waits on: the nodes furthest behind and the workers that hold them. Pure.

The job's progress watchdog (``orchestrator/job/watchdog.py``) says when a job stalled; these say
whom to blame (a stall's recovery re-fences them) and which nodes may still be compiling their
first call (the watchdog then waits longer before calling it a stall).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping


def lagging_nodes(nodes: Iterable[tuple[str, str]], done_through: Callable[[str], int],
                  steps: int) -> list[tuple[str, str]]:
    """The (node, slice) pairs furthest behind; none when every node is at ``steps``."""
    pairs = list(nodes)
    progress = {n: done_through(n) for n, _ in pairs}
    if not progress:
        return []
    low = min(progress.values())
    return [] if low >= steps else [(n, sl) for n, sl in pairs if progress[n] == low]


def laggards(nodes: Iterable[tuple[str, str]], done_through: Callable[[str], int], worker_of: Mapping[str, str],
             steps: int) -> dict[str, str]:
    """The workers holding the nodes furthest behind, each with why.

    ``nodes``: (node, slice) pairs; ``worker_of``: slice -> worker. A job that is not
    behind anywhere (every node at ``steps``) has none.
    """
    out: dict[str, str] = {}
    for n, sl in lagging_nodes(nodes, done_through, steps):
        if sl in worker_of:
            out.setdefault(worker_of[sl], f"node {n!r} made no progress past step {done_through(n)}")
    return out
