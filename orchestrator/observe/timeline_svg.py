"""The timeline chart of a run, as an inline SVG: the step each node reached over time, faults and recoveries.

Pure drawing over plain data, shared by the chaos reports (``chaos/report.py``) and the
leader's dashboard (``orchestrator/service/dashboard.py``), so both draw the same chart. Every
text that comes from the data is HTML-escaped.
"""

from __future__ import annotations

import html
from typing import Any

PALETTE = ("#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#637939")

# Chart geometry, in SVG user units.
_W, _H = 960, 440
_LEFT, _RIGHT, _TOP, _BOTTOM = 60, 780, 30, 390


def timeline_svg(summary: dict[str, Any]) -> str:
    """The inline SVG timeline of ``summary``: step against seconds since ``started_at``.

    Reads ``started_at``, ``ended_at``, ``job.steps``, ``progress`` (``{t, node, step}``),
    ``faults`` (``{kind, target, at, healed_at}``) and ``recoveries`` (``{recovery,
    detected_at, mttr_s}``); times are epoch seconds.
    """
    esc = html.escape
    t0 = float(summary.get("started_at") or 0.0)
    progress = summary.get("progress") or []
    faults = summary.get("faults") or []
    recoveries = summary.get("recoveries") or []
    ends = [_since(summary.get("ended_at"), t0) or 0.0]
    ends += [p["t"] - t0 for p in progress]
    ends += [_since(f.get(k), t0) or 0.0 for f in faults for k in ("at", "healed_at")]
    ends += [(_since(r.get("detected_at"), t0) or 0.0) + (r.get("mttr_s") or 0.0) for r in recoveries]
    x_max = max([1.0, *ends])
    y_max = max([1, (summary.get("job") or {}).get("steps") or 0, *(p["step"] for p in progress)])

    def x(t: float) -> float:
        return _LEFT + (_RIGHT - _LEFT) * max(0.0, t) / x_max

    def y(step: float) -> float:
        return _BOTTOM - (_BOTTOM - _TOP) * step / y_max

    out = [f'<svg width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" font-size="11" '
           'font-family="sans-serif" role="img">']
    for i in range(6):  # axes with ticks
        tx, sy = x_max * i / 5, y_max * i / 5
        out.append(f'<line x1="{x(tx):.1f}" y1="{_BOTTOM}" x2="{x(tx):.1f}" y2="{_BOTTOM + 4}" stroke="#000"/>'
                   f'<text x="{x(tx):.1f}" y="{_BOTTOM + 16}" text-anchor="middle">{tx:.3g}</text>'
                   f'<line x1="{_LEFT - 4}" y1="{y(sy):.1f}" x2="{_RIGHT}" y2="{y(sy):.1f}" stroke="#eee"/>'
                   f'<text x="{_LEFT - 6}" y="{y(sy) + 4:.1f}" text-anchor="end">{sy:.3g}</text>')
    out.append(f'<line x1="{_LEFT}" y1="{_BOTTOM}" x2="{_RIGHT}" y2="{_BOTTOM}" stroke="#000"/>'
               f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_BOTTOM}" stroke="#000"/>'
               f'<text x="{(_LEFT + _RIGHT) / 2}" y="{_BOTTOM + 34}" text-anchor="middle">'
               'seconds since start</text>'
               f'<text x="14" y="{(_TOP + _BOTTOM) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {(_TOP + _BOTTOM) / 2})">step</text>')
    for n, r in enumerate(recoveries):
        start = _since(r.get("detected_at"), t0) or 0.0
        label = esc(f"recovery {r.get('recovery', n + 1)}")
        mttr = r.get("mttr_s")
        if mttr is None:
            out.append(f'<line x1="{x(start):.1f}" y1="{_TOP}" x2="{x(start):.1f}" y2="{_BOTTOM}" '
                       'stroke="#2a9d2a" stroke-width="2"/>')
        else:
            width = max(1.0, x(start + mttr) - x(start))
            out.append(f'<rect x="{x(start):.1f}" y="{_TOP}" width="{width:.1f}" height="{_BOTTOM - _TOP}" '
                       'fill="#2a9d2a" fill-opacity="0.25"/>')
        out.append(f'<text x="{x(start) + 3:.1f}" y="{_BOTTOM - 6 - 12 * (n % 4)}" fill="#1e6e1e">{label}</text>')
    for n, f in enumerate(faults):
        at = _since(f.get("at"), t0) or 0.0
        healed = _since(f.get("healed_at"), t0)
        if healed is not None:
            out.append(f'<rect x="{x(at):.1f}" y="{_TOP}" width="{max(1.0, x(healed) - x(at)):.1f}" '
                       f'height="{_BOTTOM - _TOP}" fill="#d62728" fill-opacity="0.1"/>')
        out.append(f'<line x1="{x(at):.1f}" y1="{_TOP}" x2="{x(at):.1f}" y2="{_BOTTOM}" stroke="#d62728" '
                   'stroke-width="1.5" stroke-dasharray="5,4"/>'
                   f'<text x="{x(at) + 3:.1f}" y="{_TOP + 12 + 12 * (n % 4)}" fill="#d62728">'
                   f'{esc(str(f.get("kind", "")) + " " + str(f.get("target", "")))}</text>')
    by_node: dict[str, list[tuple[float, int]]] = {}
    for p in progress:
        by_node.setdefault(str(p["node"]), []).append((p["t"] - t0, p["step"]))
    for n, (node, points) in enumerate(by_node.items()):
        colour = PALETTE[n % len(PALETTE)]
        points.sort()
        if len(points) == 1:
            points.append(points[0])
        coords = " ".join(f"{x(t):.1f},{y(s):.1f}" for t, s in points)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.5">'
                   f'<title>{esc(node)}</title></polyline>'
                   f'<rect x="{_RIGHT + 20}" y="{_TOP + 16 * n}" width="12" height="12" fill="{colour}"/>'
                   f'<text x="{_RIGHT + 38}" y="{_TOP + 16 * n + 10}">{esc(node)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _since(t: float | None, origin: float | None) -> float | None:
    return None if t is None or origin is None else float(t) - float(origin)
