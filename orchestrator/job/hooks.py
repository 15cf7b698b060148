"""Fault hooks for tests, injected through configuration (never read from the environment).

A coordinator gets them from its command line (``cluster/daemons.py``, hidden flags) or
from whoever constructs it; production runs leave them at their defaults.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

FINISH_GATE_S = 120.0  # the longest a gated finish waits for the test's go; then it goes on
FINISH_GATE_POLL_S = 0.05


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
        finish_gate: a directory (empty: none). A job entering FINISHING writes
            ``JOB.finishing`` there and fetches its final state only once ``JOB.go`` is
            there too (at most :data:`FINISH_GATE_S` later), so a test can lose a
            worker right as the final state is fetched (:meth:`at_finish`).
    """

    skip_replay: bool = False
    leased: Callable[[Mapping[str, tuple[str, ...]]], None] | None = None
    finish_gate: str = ""

    def at_finish(self, job: str) -> None:
        """The finish gate of ``job``: say FINISHING is entered, and wait for the go (none: return at once)."""
        if not self.finish_gate:
            return
        gate = Path(self.finish_gate)
        (gate / f"{job}.finishing").touch()
        deadline = time.monotonic() + FINISH_GATE_S
        while not (gate / f"{job}.go").exists() and time.monotonic() < deadline:
            time.sleep(FINISH_GATE_POLL_S)
