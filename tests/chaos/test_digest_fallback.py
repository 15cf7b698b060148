"""When the chaos digest check compares bitwise and when it falls back to the job's tolerance
(docs/platforms.md): a device-count change, or a worker without deterministic kernels."""

from __future__ import annotations

import numpy as np

from rallypoint.chaos.invariants import check_digest
from rallypoint.proto.digest import RESHARD_TOLERANCE

WANT = {"w": [np.array([1.0, 2.0], np.float32)]}
CLOSE = {"w": [np.array([1.0, 2.0 + 1e-6], np.float32)]}


def test_a_job_on_nondeterministic_kernels_is_compared_within_the_tolerance_and_a_deterministic_one_bitwise() -> None:
    c = check_digest("aa", "bb", got_states=CLOSE, want_states=WANT, tolerance=RESHARD_TOLERANCE,
                     nondeterministic=["g0"])
    assert c.ok and "g0 without deterministic kernels" in c.evidence and "not bitwise" in c.evidence, c
    c = check_digest("aa", "bb", got_states=CLOSE, want_states=WANT, tolerance=RESHARD_TOLERANCE)
    assert not c.ok and "bitwise" in c.evidence, c  # deterministic kernels: the digests must be equal
    c = check_digest("aa", "bb", nondeterministic=["g0"])
    assert not c.ok and "no final states or tolerance" in c.evidence, c
