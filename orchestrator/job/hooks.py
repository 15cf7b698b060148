"""Fault hooks for tests, injected through configuration (never read from the environment).

A coordinator gets them from its command line (``cluster/daemons.py``, hidden flags) or
from whoever constructs it; production runs leave them at their defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ExecutorHooks:
    """Deliberate breakage of the executor, so tests can prove their checks catch it.

    Attributes:
        skip_replay: a moved slice restores its checkpoint but starts where it had
            got, skipping the replay (the chaos suite proves its invariants catch this).
        leased: called (slice -> its workers, a multi-host slice's lead first) once a placement
            has leased every slice, before it checks the workers it chose are still there and
            the job is loaded: a test kills one of them there (only a coordinator built
            in-process can have it).
    """

    skip_replay: bool = False
    leased: Callable[[Mapping[str, tuple[str, ...]]], None] | None = None
