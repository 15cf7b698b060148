"""The `rallypoint` command as a user runs it: a subprocess from the repository's root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def rp(*args: str, check: bool = True, timeout: float = 120,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "rallypoint.cli", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **env} if env else None)
    if check and r.returncode != 0:
        raise AssertionError(f"rallypoint {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r
