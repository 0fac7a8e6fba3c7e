"""The one base class of every typed config section (connectors, trainer and
pipeline sections alike).

It lives in the lowest package, :mod:`connectors`, because every package may
import from it and ``connectors`` imports no other package of ours.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are refused (a typo is an error, not a silent default), values are
    frozen once validated, and ``inf``/``nan`` are refused in float fields."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
