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


def test_the_orchestrator_modules_stay_under_500_lines() -> None:
    """The job core was split where its concepts part (executor, events, losses; the service's registry,
    fan-out, adoption, links): a module of orchestrator/ past 500 lines is one to split again."""
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in (ROOT / "orchestrator").rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 500]
    assert big == []
