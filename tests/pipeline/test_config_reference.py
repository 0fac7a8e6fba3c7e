"""The configuration reference of the docs site is generated from the config classes (pipeline/config_reference.py)."""

from __future__ import annotations

import pytest
from pydantic import Field

from connectors.config_base import Section
from pipeline import config_reference
from pipeline.config import HourglassConfig
from tests import REPO


def test_every_config_field_has_a_description() -> None:
    assert config_reference.fields_without_description() == []


def test_the_reference_names_every_section_and_field() -> None:
    text = config_reference.render()
    headings = [doc.heading for doc in config_reference.sections()]
    for must in (
        "[kafka]",
        "[buffer.reward]",
        "[[candidates]]",
        "[[candidates.reward]]",
        "[serving.canary]",
        "[serving.guard]",
    ):
        assert must in headings
    for doc in config_reference.sections():
        assert f"`{doc.heading}` {{#{doc.anchor}}}" in text
    for name in HourglassConfig.model_fields:
        assert f"| `{name}` |" in text
    assert "`HOURGLASS_SERVING__CANARY__FRACTION`" in text  # nested sections get their variable
    assert "| `fraction` | number; >= 0.0001, <= 0.99 | `0.2` |" in text  # type, bounds and default from the field
    assert "| `name` | string | required |" in text  # [[candidates]]: a required field


class _Inner(Section):
    """An inner table."""

    depth: int = Field(default=2, ge=1, description="How deep.")


class _Term(Section):
    """One term."""

    fn: str = Field(description="Which function.")


class _Middle(Section):
    """A middle table."""

    inner: _Inner = Field(default_factory=_Inner)
    terms: list[_Term] = Field(default_factory=lambda: [_Term(fn="a")], description="Terms.")


class _Outer(Section):
    """The outer table."""

    middle: _Middle = Field(default_factory=_Middle)
    maybe: _Inner | None = Field(default=None, description="An optional table.")
    plain: str = Field(default="x", description="A plain field.")


class _Root(Section):
    outer: _Outer = Field(default_factory=_Outer)


def test_nested_sections_are_walked_at_any_depth() -> None:
    """Any field whose type is a Section (or a list or optional of one) becomes its own table."""
    headings = [doc.heading for doc in config_reference.sections(_Root)]
    assert headings == [
        "[outer]",
        "[outer.middle]",
        "[outer.middle.inner]",
        "[[outer.middle.terms]]",
        "[outer.maybe]",
    ]
    text = config_reference.render(_Root)
    assert "`HOURGLASS_OUTER__MIDDLE__INNER__DEPTH`" in text
    assert "The same fields as [`[outer.middle.inner]`](#outer-middle-inner)." in text  # _Inner used twice
    assert "| `maybe` | [table](#outer-maybe) | see below |" in text  # each table field links to its own heading
    assert '| `terms` | [array of tables](#outer-middle-terms) | `[{fn = "a"}]` |' in text
    assert config_reference.fields_without_description(_Root) == []


def test_a_field_without_a_description_is_found() -> None:
    class Bare(Section):
        """A table."""

        undocumented: int = 1

    class Root(Section):
        bare: Bare = Field(default_factory=Bare)

    assert config_reference.fields_without_description(Root) == ["bare.undocumented"]


def test_the_configuration_page_holds_the_marker() -> None:
    page = (REPO / "docs" / "configuration.md").read_text()
    assert config_reference.MARKER in page
    assert config_reference.MARKER not in config_reference.expand(page)
    with pytest.raises(ValueError, match="no <!-- config-reference --> marker"):
        config_reference.expand("# Configuration\n")


def test_the_commented_example_config_is_current_and_loads_to_the_defaults() -> None:
    """deploy/reference.toml is generated from the config classes: every field, under its description, at its
    default. Regenerate it with `python -m pipeline.config_reference > deploy/reference.toml`."""
    from pipeline.config import load_config
    from tests import REPO

    path = REPO / "deploy" / "reference.toml"
    assert path.read_text() == config_reference.example_toml(), "deploy/reference.toml is stale: regenerate it"
    assert load_config(path).model_dump() == load_config(None).model_dump()
    text = path.read_text()
    for doc in config_reference.sections():  # every table of the reference is in the example
        assert f"[{doc.dotted}]" in text, doc.dotted
