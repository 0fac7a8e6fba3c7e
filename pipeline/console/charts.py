"""Small server-side SVG charts (no JavaScript, no external library).

Every label passes through :func:`html.escape`; only presentation attributes
are used (no ``style=``), so the page's Content-Security-Policy can forbid
inline styles and scripts. Each point carries a ``<title>`` (hover tooltip).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from html import escape

PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777")
W, H = 560, 230
LEFT, RIGHT, TOP, BOTTOM = 48, 30, 14, 56


def _nice_range(values: Sequence[float], fixed: tuple[float, float] | None) -> tuple[float, float]:
    if fixed is not None:
        return fixed
    lo, hi = min(values), max(values)
    if math.isclose(lo, hi):
        lo, hi = lo - 0.5, hi + 0.5
    pad = (hi - lo) * 0.08
    return lo - pad, hi + pad


def _frame(lo: float, hi: float, title: str, y_format: Callable[[float], str]) -> list[str]:
    out = [f'<text x="{LEFT}" y="10" font-size="11" fill="#374151">{escape(title)}</text>']
    for i in range(5):
        v = lo + (hi - lo) * i / 4
        y = TOP + (H - TOP - BOTTOM) * (1 - i / 4)
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        out.append(
            f'<text x="{LEFT - 4}" y="{y + 3:.1f}" font-size="10" text-anchor="end" fill="#6b7280">{escape(y_format(v))}</text>'
        )
    out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{H - BOTTOM}" stroke="#9ca3af"/>')
    return out


def _legend(names: Sequence[str]) -> list[str]:
    out, x = [], LEFT
    for i, name in enumerate(names):
        label = name if len(name) <= 28 else name[:27] + "…"
        colour = PALETTE[i % len(PALETTE)]
        out.append(f'<rect x="{x}" y="{H - 14}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{x + 14}" y="{H - 5}" font-size="10" fill="#374151">{escape(label)}</text>')
        x += 24 + 6 * len(label)
    return out


def _svg(body: list[str], label: str, kind: str) -> str:
    return (
        f'<svg class="chart" data-chart="{escape(kind)}" role="img" aria-label="{escape(label)}" viewBox="0 0 {W} {H}" '
        f'width="{W}" height="{H}" xmlns="http://www.w3.org/2000/svg">' + "".join(body) + "</svg>"
    )


def line_chart(
    series: Mapping[str, Sequence[tuple[float, float | None]]],
    *,
    title: str,
    kind: str,
    x_format: Callable[[float], str] = lambda x: f"{x:g}",
    y_format: Callable[[float], str] = lambda y: f"{y:.2f}",
    y_range: tuple[float, float] | None = None,
    dashed: Sequence[str] = (),
) -> str:
    """An SVG line chart; ``series`` is ``{name: [(x, y), ...]}`` (NaN/None points are skipped).

    Returns an ``<svg class="chart" data-chart=kind>`` string; empty series give a chart that says so.
    """
    clean = {
        name: [(float(x), float(y)) for x, y in pts if y is not None and math.isfinite(float(y))]
        for name, pts in series.items()
    }
    points = [p for pts in clean.values() for p in pts]
    if not points:
        return _svg(
            _frame(0, 1, title, y_format)
            + [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" fill="#6b7280">no data yet</text>'],
            title,
            kind,
        )
    xs = sorted({x for x, _ in points})
    x_lo, x_hi = xs[0], xs[-1]
    lo, hi = _nice_range([y for _, y in points], y_range)

    def px(x: float) -> float:
        return LEFT + 8 + (W - LEFT - RIGHT - 16) * ((x - x_lo) / (x_hi - x_lo) if x_hi > x_lo else 0.5)

    def py(y: float) -> float:
        return TOP + (H - TOP - BOTTOM) * (1 - (min(max(y, lo), hi) - lo) / (hi - lo))

    body = _frame(lo, hi, title, y_format)
    step = max(1, len(xs) // 8)
    for x in xs[::step]:
        body.append(
            f'<text x="{px(x):.1f}" y="{H - BOTTOM + 14}" font-size="10" text-anchor="middle" fill="#6b7280">{escape(x_format(x))}</text>'
        )
    for i, (name, pts) in enumerate(clean.items()):
        colour = PALETTE[i % len(PALETTE)]
        if len(pts) > 1:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            dash = ' stroke-dasharray="5 3"' if name in dashed else ""
            body.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        for x, y in pts:
            tip = f"{name}: {y_format(y)} at {x_format(x)}"
            body.append(
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{colour}"><title>{escape(tip)}</title></circle>'
            )
    return _svg(body + _legend(list(clean)), title, kind)


def bar_chart(labels: Sequence[str], series: dict[str, Sequence[float]], *, title: str, kind: str) -> str:
    """Grouped bars: one group per label, one bar per series (``{name: [value per label]}``)."""
    values = [v for vals in series.values() for v in vals]
    if not labels or not values:
        return _svg(
            _frame(0, 1, title, lambda y: f"{y:g}")
            + [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" fill="#6b7280">no data yet</text>'],
            title,
            kind,
        )
    hi = max(values) or 1.0
    body = _frame(0, hi * 1.08, title, lambda y: f"{y:,.0f}")
    group = (W - LEFT - RIGHT) / len(labels)
    bar = max(1.0, group * 0.8 / max(1, len(series)))
    step = max(1, len(labels) // 8)
    for j, label in enumerate(labels):
        if j % step == 0:
            body.append(
                f'<text x="{LEFT + group * (j + 0.5):.1f}" y="{H - BOTTOM + 14}" font-size="10" text-anchor="middle" fill="#6b7280">{escape(label)}</text>'
            )
        for i, (name, vals) in enumerate(series.items()):
            v = vals[j]
            h = (H - TOP - BOTTOM) * v / (hi * 1.08)
            x = LEFT + group * j + group * 0.1 + bar * i
            body.append(
                f'<rect x="{x:.1f}" y="{H - BOTTOM - h:.1f}" width="{bar:.1f}" height="{h:.1f}" fill="{PALETTE[i % len(PALETTE)]}">'
                f"<title>{escape(f'{name} {label}: {v:,.0f}')}</title></rect>"
            )
    return _svg(body + _legend(list(series)), title, kind)
