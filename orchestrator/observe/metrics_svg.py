"""A job's metric curves as an inline SVG: each metric against the step, faults and recoveries marked.

Pure drawing over plain data, for the leader's dashboard (``orchestrator/service/dashboard.py``);
``rallypoint plot`` draws the same curves and marks as a PNG from the run's ``metrics.jsonl``
(``client/commands/plot.py``). One panel per metric (at most :data:`MAX_PANELS`, ``loss`` first), sharing the
step axis.
Every text that comes from the data is HTML-escaped.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from rallypoint.orchestrator.observe.timeline_svg import PALETTE

MAX_PANELS = 4
_W, _PANEL_H = 960, 170
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 900, 22, 140  # one panel's plot area (y offsets within the panel)
MARK_COLOURS = {"fault": "#d62728", "stall": "#b36b00", "nonfinite": "#d62728", "resumed": "#7f7f7f",
                "adopted": "#7f7f7f", "spike": "#9467bd", "rollback": "#9467bd"}


def metrics_svg(curves: Mapping[str, Sequence[Sequence[Any]]], marks: Sequence[Mapping[str, Any]],
                steps: int = 0) -> str:
    """The SVG of ``curves`` (metric -> ``[step, value]`` pairs, value None where it was not finite)
    with ``marks`` (``{kind, step, from_step?, label}``: ``kind`` "recovery" is a band from
    ``from_step`` to ``step``, any other kind a line at ``step``). "" when there is no curve."""
    names = sorted(curves, key=lambda n: (n != "loss", n))[:MAX_PANELS]  # the loss first
    if not names:
        return ""
    last = max([steps, 1, *(int(p[0]) for n in names for p in curves[n]), *(int(m.get("step", 0)) for m in marks)])
    height = _PANEL_H * len(names) + 24
    out = [f'<svg width="{_W}" height="{height}" viewBox="0 0 {_W} {height}" font-size="11" '
           'font-family="sans-serif" role="img">']

    def x(step: float) -> float:
        return _LEFT + (_RIGHT - _LEFT) * max(0.0, step) / last

    for i, name in enumerate(names):
        out.append(_panel(name, curves[name], marks, i * _PANEL_H, x, PALETTE[i % len(PALETTE)], last))
    out.append(f'<text x="{(_LEFT + _RIGHT) / 2}" y="{height - 6}" text-anchor="middle">step</text></svg>')
    return "\n".join(out)


def _panel(name: str, points: Sequence[Sequence[Any]], marks: Sequence[Mapping[str, Any]], dy: int, x: Any,
           colour: str, last: int) -> str:
    esc = html.escape
    finite = [float(v) for _, v in points if v is not None and math.isfinite(float(v))]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    pad = (hi - lo) * 0.05
    lo, hi = lo - pad, hi + pad
    top, bottom = dy + _TOP, dy + _BOTTOM

    def y(v: float) -> float:
        return bottom - (bottom - top) * (v - lo) / (hi - lo)

    out = [f'<g class="metric" data-metric="{esc(name)}" data-points="{len(points)}">',
           f'<text x="{_LEFT}" y="{top - 6}" font-weight="bold">{esc(name)}</text>']
    for k in range(5):  # axes with ticks
        v, s = lo + (hi - lo) * k / 4, last * k / 4
        out.append(f'<line x1="{_LEFT - 4}" y1="{y(v):.1f}" x2="{_RIGHT}" y2="{y(v):.1f}" stroke="#eee"/>'
                   f'<text x="{_LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.4g}</text>'
                   f'<line x1="{x(s):.1f}" y1="{bottom}" x2="{x(s):.1f}" y2="{bottom + 4}" stroke="#000"/>'
                   f'<text x="{x(s):.1f}" y="{bottom + 15}" text-anchor="middle">{s:.4g}</text>')
    out.append(f'<line x1="{_LEFT}" y1="{bottom}" x2="{_RIGHT}" y2="{bottom}" stroke="#000"/>'
               f'<line x1="{_LEFT}" y1="{top}" x2="{_LEFT}" y2="{bottom}" stroke="#000"/>')
    for n, m in enumerate(marks):
        kind, step, label = str(m.get("kind", "")), int(m.get("step", 0)), esc(str(m.get("label", m.get("kind", ""))))
        ty = top + 11 + 11 * (n % 3)
        if kind == "recovery":
            start = int(m.get("from_step", step))
            out.append(f'<rect class="mark" data-kind="recovery" x="{x(start):.1f}" y="{top}" '
                       f'width="{max(1.0, x(step) - x(start)):.1f}" height="{bottom - top}" fill="#2a9d2a" '
                       f'fill-opacity="0.2"/><text x="{x(start) + 3:.1f}" y="{ty}" fill="#1e6e1e">{label}</text>')
        else:
            c = MARK_COLOURS.get(kind, "#7f7f7f")
            out.append(f'<line class="mark" data-kind="{esc(kind)}" x1="{x(step):.1f}" y1="{top}" x2="{x(step):.1f}" '
                       f'y2="{bottom}" stroke="{c}" stroke-width="1.5" stroke-dasharray="5,4"/>'
                       f'<text x="{x(step) + 3:.1f}" y="{ty}" fill="{c}">{label}</text>')
    segment: list[str] = []
    for step, v in [*points, (None, None)]:  # a value that is not finite breaks the line
        if v is not None and step is not None and math.isfinite(float(v)):
            segment.append(f"{x(float(step)):.1f},{y(float(v)):.1f}")
            continue
        if segment:
            if len(segment) == 1:
                segment.append(segment[0])
            out.append(f'<polyline points="{" ".join(segment)}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        segment = []
    out.append("</g>")
    return "\n".join(out)
