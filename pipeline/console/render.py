"""HTML of the status page: Jinja2 templates with autoescaping on, plus the SVG charts.

Everything from traffic, MLflow or the round store is inserted as text and
escaped by Jinja2; the only markup inserted as-is is the SVG from
:mod:`pipeline.console.charts`, which escapes its own labels.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from pipeline.console.charts import bar_chart, line_chart

_ENV = Environment(
    loader=PackageLoader("pipeline.console", "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
)


def _num(value: Any, digits: int = 3) -> str:
    """``0.123`` style, ``–`` for None/NaN."""
    if value is None:
        return "–"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return "–" if not math.isfinite(number) else f"{number:.{digits}f}"


def _duration(seconds: Any) -> str:
    if seconds is None:
        return "–"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%H:%M")


def _round_label(i: int, round_id: str) -> str:
    """``#3 14:05`` for round ``r20260101T140512-ab12cd`` (its UTC start), ``#3`` for other ids."""
    stamp = round_id[10:14] if round_id[:1] == "r" and round_id[9:10] == "T" else ""
    return f"#{i} {stamp[:2]}:{stamp[2:]}" if stamp.isdigit() else f"#{i}"


_ENV.filters.update(num=_num, duration=_duration)


def charts(data: dict[str, Any]) -> dict[str, Markup]:
    """The page's SVG charts from :meth:`ConsoleData.collect` output, keyed by name."""
    rounds = [r for r in reversed(data["rounds"]) if r["decisions"]]  # oldest first
    champion: dict[str, list[tuple[float, float | None]]] = {}  # None: no finite reward (not drawn)
    for i, r in enumerate(rounds, start=1):
        for d in r["decisions"]:
            best = max(
                (c["reward"] for c in d["candidates"] if c["reward"] is not None and math.isfinite(c["reward"])),
                default=None,
            )
            champion.setdefault(f"{d['model']} champion", []).append((i, d["champion_reward"]))
            champion.setdefault(f"{d['model']} best candidate", []).append((i, best))
    labels = {i: _round_label(i, r["round_id"]) for i, r in enumerate(rounds, start=1)}
    out = {
        "heldout": line_chart(
            champion,
            title="held-out reward by round (champion vs best candidate)",
            kind="heldout",
            x_format=lambda x: labels.get(int(x), f"{x:g}"),
            dashed=[k for k in champion if k.endswith("best candidate")],
        ),
        "feedback": line_chart(
            {
                f"v{v}" if v != "base" else "base": [(t, rate) for t, rate, _ in pts]
                for v, pts in data["feedback"]["series"].items()
            },
            title="live thumbs-up rate by served version",
            kind="feedback",
            x_format=_clock,
            y_format=lambda y: f"{y:.0%}",
            y_range=(0.0, 1.0),
        ),
    }
    auc = [
        (i, r["reward_model_auc"])
        for i, r in enumerate(reversed(data["rounds"]), start=1)
        if r["reward_model_auc"] is not None
    ]
    if auc:
        out["auc"] = line_chart(
            {"reward model AUC": auc}, title="reward model held-out AUC by round", kind="auc", y_range=(0.0, 1.0)
        )
    hourly = data["ingest"]["hourly"]
    out["hourly"] = bar_chart(
        [h["hour"][11:16] for h in hourly],
        {"traces": [h["traces"] for h in hourly], "feedback": [h["feedback"] for h in hourly]},
        title="traces and feedback per hour (UTC)",
        kind="hourly",
    )
    return {name: Markup(svg) for name, svg in out.items()}


def render_panels(data: dict[str, Any], *, canary_abort: str | None = None) -> str:
    """The refreshable part of the page (HTML fragment); ``canary_abort``: the abort endpoint's path (None: no button)."""
    return _ENV.get_template("panels.html.j2").render(d=data, charts=charts(data), canary_abort=canary_abort)


def render_page(data: dict[str, Any], *, canary_abort: str | None = None, refresh_s: int = 10) -> str:
    """The whole page (HTML document)."""
    panels = Markup(render_panels(data, canary_abort=canary_abort))
    models = [m["model"] for m in data["models"]]
    return _ENV.get_template("page.html.j2").render(
        d=data, panels=panels, models=models, canary_abort=canary_abort, refresh_s=refresh_s
    )
