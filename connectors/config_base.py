"""The one base class of every typed config section (connectors, trainer and
pipeline sections alike).

It lives in the lowest package, :mod:`connectors`, because every package may
import from it and ``connectors`` imports no other package of ours.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _types(annotation: Any) -> set[Any]:
    """The plain types an annotation admits: ``int | None`` -> {int, NoneType}; ``Annotated[float, ...]`` ->
    {float}; ``list[int]`` -> {list}."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_types(a) for a in typing.get_args(annotation)))
    return {origin or annotation}


class Section(BaseModel):
    """A config section: unknown keys are refused (a typo is an error, not a silent default), values are
    frozen once validated, ``inf``/``nan`` are refused in float fields, and ``true``/``false`` are refused in
    number fields (pydantic's lax mode would read ``eval_prompts = true`` as 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            admits = _types(cls.model_fields[info.field_name].annotation)
            if bool not in admits and admits & {int, float}:
                raise ValueError("expected a number, not true or false")
        return value
