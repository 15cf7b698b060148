"""Fault hooks for tests, injected through configuration (never read from the environment).

A coordinator gets them from its command line (``cluster/daemons.py``, hidden flags) or
from whoever constructs it; production runs leave them at their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExecutorHooks:
    """Deliberate breakage of the executor, so tests can prove their checks catch it.

    Attributes:
        skip_replay: a moved slice restores its checkpoint but starts where it had
            got, skipping the replay (the chaos suite proves its invariants catch this).
    """

    skip_replay: bool = False
