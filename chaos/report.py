"""Reports of chaos runs: one folder per run, for people and for code.

A report folder holds two files::

    DIRECTORY/
      summary.json    the run's summary as the harness recorded it (the source of truth)
      timeline.html   a self-contained page: an inline SVG chart of the step each node
                      reached over time, with faults and recoveries marked, then the
                      invariants and the outcome

:func:`write_report` writes both, :func:`load_report` reads ``summary.json`` back and
:func:`format_table` renders a summary as plain text for a terminal. Each file is written
to a temporary name and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rallypoint.basics.errors import RallypointError
from rallypoint.orchestrator.job.recovery import PHASES
from rallypoint.orchestrator.observe.timeline_svg import timeline_svg as _svg

SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.html"
LIBRARY_LOG_FILE = "libraries.log"  # absl/Orbax/JAX logging of the runner's own process, kept off the terminal
EVIDENCE_CHARS = 100


class ReportError(RallypointError):
    """A report folder is missing or its summary cannot be read."""


def write_report(directory: Path, summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` and ``timeline.html`` for one chaos run.

    Args:
        directory: the report folder; created with its parents when absent.
        summary: the run's summary (see the module docstring of the harness).

    Returns:
        ``directory``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_atomic(directory / SUMMARY_FILE, json.dumps(summary, indent=1) + "\n")
    _write_atomic(directory / TIMELINE_FILE, render_html(summary))
    return directory


def load_report(directory: Path) -> dict[str, Any]:
    """Read back the summary of a report folder written by :func:`write_report`.

    Raises:
        ReportError: the folder or its ``summary.json`` is missing, unreadable or
            not a JSON object; the message names the path.
    """
    directory = Path(directory)
    path = directory / SUMMARY_FILE
    if not directory.is_dir():
        raise ReportError(f"report folder {directory} does not exist; pass the folder "
                          f"that write_report created (it holds {SUMMARY_FILE})")
    if not path.is_file():
        raise ReportError(f"{path} is missing: {directory} is not a complete report "
                          "folder; rerun the chaos scenario to write it again")
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"cannot read {path}: {exc}; check its permissions") from exc
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path} is not valid JSON ({exc}); the file was damaged or "
                          "written by something else, rerun the chaos scenario") from exc
    if not isinstance(summary, dict):
        raise ReportError(f"{path} holds a JSON {type(summary).__name__}, not an object; "
                          "rerun the chaos scenario to write it again")
    return summary


def format_table(summary: dict[str, Any]) -> str:
    """Render a summary as plain text: header, faults, recoveries, invariants, goodput."""
    t0 = float(summary.get("started_at") or 0.0)
    outcome = summary.get("outcome") or {}
    network = (summary.get("cluster") or {}).get("network", "-")
    state = outcome.get("state", "-")
    header = (f"{summary.get('scenario', '?')}  seed={summary.get('seed', '-')}  "
              f"network={network}  outcome={state} (expected {outcome.get('expected', '-')})  "
              f"wall {_num(outcome.get('wall_s'), '.1f')}s / bound {_num(outcome.get('time_bound_s'), 'g')}s")
    lines = [header]
    if outcome.get("reason"):
        lines.append(f"reason: {outcome['reason']}")

    faults = summary.get("faults") or []
    lines += ["", f"faults ({len(faults)})"]
    lines += _table(("kind", "target", "worker", "step", "at_s", "healed_after_s"), [
        (f.get("kind"), f.get("target"), f.get("worker"), f.get("step"),
         _num(_since(f.get("at"), t0), ".2f"), _num(_since(f.get("healed_at"), f.get("at")), ".2f"))
        for f in faults])

    recoveries = summary.get("recoveries") or []
    lines += ["", f"recoveries ({len(recoveries)})"]
    lines += _table(("#", "lost", "policy", "ckpt_step", *PHASES, "mttr_s"), [
        (r.get("recovery"), _lost(r.get("lost")), r.get("policy"), r.get("checkpoint_step"),
         *(_num((r.get("phases") or {}).get(p), ".3f") for p in PHASES), _num(r.get("mttr_s"), ".3f"))
        for r in recoveries])

    drains = summary.get("drains") or []
    if drains:
        lines += ["", f"drains ({len(drains)})"]
        lines += _table(("#", "worker", "reason", "state", "moved", "step", "save_s", "paused_s"), [
            (d.get("drain"), d.get("worker"), d.get("reason"), d.get("state"),
             "; ".join(f"{sl}->{w}" for sl, w in (d.get("moved") or {}).items()) or "-", d.get("step"),
             _num(d.get("save_s"), ".3f"), _num(d.get("paused_s"), ".3f")) for d in drains])

    invariants = summary.get("invariants") or []
    lines += ["", f"invariants ({len(invariants)})"]
    lines += _table(("name", "result", "evidence"), [
        (i.get("name"), "OK" if i.get("ok") else "FAILED", _truncate(i.get("evidence")))
        for i in invariants])

    g = summary.get("goodput") or {}
    m = summary.get("mttr_s") or {}
    lines += ["", f"goodput {_num(g.get('goodput'), '.3f')}  (useful {_num(g.get('useful_device_s'), '.2f')} "
                  f"device-s, redone {_num(g.get('redone_device_s'), '.2f')} device-s, "
                  f"{_num(g.get('steps_per_s'), '.2f')} steps/s, fault-free wall "
                  f"{_num(g.get('fault_free_wall_s'), '.2f')}s)",
              f"MTTR median {_num(m.get('median'), '.3f')}s  max {_num(m.get('max'), '.3f')}s"]
    return "\n".join(lines) + "\n"


def render_html(summary: dict[str, Any]) -> str:
    """The self-contained ``timeline.html`` page of a summary."""
    esc = html.escape
    title = esc(str(summary.get("scenario", "chaos run")))
    outcome = summary.get("outcome") or {}
    rows = "".join(
        f"<tr><td>{esc(str(i.get('name', '')))}</td>"
        f"<td class=\"{'ok' if i.get('ok') else 'failed'}\">{'OK' if i.get('ok') else 'FAILED'}</td>"
        f"<td>{esc(str(i.get('evidence', '')))}</td></tr>"
        for i in summary.get("invariants") or [])
    outcome_text = (f"{outcome.get('state', '-')} (expected {outcome.get('expected', '-')}) in "
                    f"{_num(outcome.get('wall_s'), '.1f')}s of a {_num(outcome.get('time_bound_s'), 'g')}s bound")
    if outcome.get("reason"):
        outcome_text += f": {outcome['reason']}"
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
        f"<title>{title}</title><style>"
        "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;vertical-align:top}"
        ".ok{color:#2a7f2a}.failed{color:#c00;font-weight:bold}"
        "</style></head><body>\n"
        f"<h1>{title}</h1>\n<p>{esc(str(summary.get('description', '')))}</p>\n"
        f"<p>seed {esc(str(summary.get('seed', '-')))}</p>\n"
        f"{_svg(summary)}\n"
        f"<h2>Outcome</h2>\n<p>{esc(outcome_text)}</p>\n"
        "<h2>Invariants</h2>\n<table><tr><th>invariant</th><th>result</th><th>evidence</th></tr>"
        f"{rows}</table>\n</body></html>\n")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Fixed-width columns, left aligned, with a rule under the header."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    if len(cells) == 1:
        return ["  (none)"]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    fmt = ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return [fmt[0], "  " + "  ".join("-" * w for w in widths), *fmt[1:]]


def _num(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` when it is missing."""
    if value is None:
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def _since(t: float | None, origin: float | None) -> float | None:
    return None if t is None or origin is None else float(t) - float(origin)


def _lost(lost: dict[str, list[str]] | None) -> str:
    """``{"w2": ["stage2"]}`` as ``w2->stage2``."""
    return "; ".join(f"{w}->{','.join(map(str, s))}" for w, s in (lost or {}).items()) or "-"


def _truncate(text: Any, limit: int = EVIDENCE_CHARS) -> str:
    flat = " ".join(str(text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
