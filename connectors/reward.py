"""Feedback signals -> one scalar reward and its source, per :class:`~connectors.config.RewardSpec`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from connectors.config import ImplicitConfig, RewardSpec

_ADJUSTMENTS = ("edited", "regenerated")
EXPLICIT = frozenset({"reward", "thumbs", "rating"})


def explicit_source(source: str | None) -> bool:
    """Whether a reward source (``"thumbs"``, ``"rating+edited"``, ``"continued"``...) is a reward the user gave:
    its first part is an explicit signal (explicit feedback wins over implicit signals, so it leads)."""
    return source is not None and source.split("+", 1)[0] in EXPLICIT


def _value(name: str, signal: Any, spec: RewardSpec) -> float | None:
    """The reward one present signal stands for, or None when it says nothing (e.g. ``edited=False``)."""
    if name == "reward":
        return float(signal)
    if name == "thumbs":
        return spec.thumbs_up if signal == "up" else spec.thumbs_down
    if name == "rating":
        return (float(signal) - 3.0) / 2.0
    if name in _ADJUSTMENTS:
        return getattr(spec, name) if signal else None
    return None


def reward_from_signals(signals: Mapping[str, Any], spec: RewardSpec) -> tuple[float | None, str | None]:
    """Map feedback signals to ``(reward, reward_source)``.

    The first signal present in ``spec.priority`` gives the base value and the
    source (``reward`` as is, ``thumbs`` up/down -> ``thumbs_up``/``thumbs_down``,
    ``rating`` r in 1..5 -> ``(r - 3) / 2``); ``edited`` / ``regenerated``
    that are true and listed in the priority add their (negative) values, and
    are named in the source (``"thumbs+edited"``). The sum is clipped to
    ``[-spec.clip, spec.clip]``.

    Returns:
        ``(None, None)`` when no listed signal is present.
    """
    base: float | None = None
    parts: list[str] = []
    adjust = 0.0
    for name in spec.priority:
        if name not in signals or signals[name] is None:
            continue
        value = _value(name, signals[name], spec)
        if value is None or not math.isfinite(value):
            continue
        if name in _ADJUSTMENTS:
            adjust += value
            parts.append(name)
        elif base is None:
            base = value
            parts.insert(0, name)
    if not parts:
        return None, None
    total = (base or 0.0) + adjust
    return max(-spec.clip, min(spec.clip, total)), "+".join(parts)


def merge_signals(inline: Mapping[str, Any], feedback: Iterable[tuple[datetime, Mapping[str, Any]]]) -> dict[str, Any]:
    """Inline trace signals overridden by feedback events, later feedback (by ts) winning per signal.

    Idempotent under duplicates: a redelivered feedback event changes nothing.
    """
    merged = dict(inline)
    for _, signals in sorted(feedback, key=lambda item: item[0]):
        merged.update({k: v for k, v in signals.items() if v is not None})
    return merged


def with_implicit(
    reward: float | None,
    source: str | None,
    signals: Mapping[str, Any],
    derived: Mapping[str, Any],
    spec: RewardSpec,
    implicit: ImplicitConfig,
) -> tuple[float | None, str | None]:
    """``(reward, source)`` of :func:`reward_from_signals` with the implicit signals ``derived`` for the trace
    (:func:`connectors.implicit.derive`) added by their weights, unless an explicit ``reward`` / ``thumbs`` /
    ``rating`` set the reward (explicit feedback wins). A derived ``regenerated`` is not counted again when
    the client flagged it; signals of weight 0 add nothing and are not named. The sum is clipped to
    ``[-spec.clip, spec.clip]``; the source names every part (``"continued"``, ``"edited+rephrased"``)."""
    if explicit_source(source):
        return reward, source
    parts = [
        name
        for name in derived
        if implicit.weight(name) != 0.0 and not (name == "regenerated" and signals.get("regenerated"))
    ]
    if not parts:
        return reward, source
    total = (reward or 0.0) + sum(implicit.weight(name) for name in parts)
    named = ([source] if source else []) + parts
    return max(-spec.clip, min(spec.clip, total)), "+".join(named)
