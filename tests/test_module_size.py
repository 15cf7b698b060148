"""DESIGN.md: a module past ~500 lines is a sign to split it (generated stubs aside)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("rallypoint", "chaos", "client", "cluster", "orchestrator", "workers", "recovery", "etcd", "basics")


def test_modules_stay_small() -> None:
    big = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for layer in LAYERS
        for p in (ROOT / layer).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    ]
    assert big == []
