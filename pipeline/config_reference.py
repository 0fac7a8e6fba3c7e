"""The configuration reference of the docs site, rendered from the config classes themselves.

Every section of ``hourglass.toml`` is a :class:`~connectors.config_base.Section` whose fields carry
their type, default, bounds and ``Field(description=...)``; :func:`render` walks
:class:`~pipeline.config.HourglassConfig` and writes one markdown table per section, so the page
cannot drift from the code. The walk is generic: any field whose type is a ``Section`` (or a list of
them, an array of tables) becomes its own section, at any depth (``[serving.canary]``,
``[[candidates.reward]]``), with the environment variable that overrides each field.

The docs build calls it through the mkdocs hook ``docs/hooks/config_reference.py``;
``tests/pipeline/test_config_reference.py`` checks that every field has a description. The same walk
writes the commented example config ``deploy/reference.toml`` (:func:`example_toml`; the test checks
it is current).
"""

from __future__ import annotations

import enum
import json
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from connectors.config_base import Section
from pipeline.config import ENV_PREFIX, HourglassConfig

MARKER = "<!-- config-reference -->"


@dataclass(frozen=True)
class SectionDoc:
    """One table of the reference: a section class at a path (``("serving", "canary")``)."""

    path: tuple[str, ...]
    model: type[BaseModel]
    array: bool  # an array of tables ([[candidates]]): the environment variable takes the whole list as JSON

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def heading(self) -> str:
        return f"[[{self.dotted}]]" if self.array else f"[{self.dotted}]"

    @property
    def anchor(self) -> str:
        return "-".join(self.path)


def _section_of(annotation: Any) -> tuple[type[Section], bool] | None:
    """``(SectionClass, is_list)`` when ``annotation`` is a Section, an optional one, or a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args:
        inner = _section_of(args[0])
        return (inner[0], True) if inner and not inner[1] else None
    if origin in (typing.Union, types.UnionType):
        found = [s for s in (_section_of(a) for a in args if a is not type(None)) if s]
        return found[0] if len(found) == 1 else None
    return None


def sections(model: type[BaseModel] = HourglassConfig, path: tuple[str, ...] = ()) -> Iterator[SectionDoc]:
    """Every section below ``model``, depth first in declaration order (nested sections after their parent)."""
    for name, field in model.model_fields.items():
        found = _section_of(field.annotation)
        if found is None:
            continue
        cls, array = found
        doc = SectionDoc(path + (name,), cls, array)
        yield doc
        yield from sections(cls, doc.path)


def fields_without_description(model: type[BaseModel] = HourglassConfig) -> list[str]:
    """Dotted paths of the fields that have no description (a section field may rely on its class docstring)."""
    missing = [
        name
        for name, field in model.model_fields.items()
        if not (field.description or "").strip() and _section_of(field.annotation) is None
    ]
    for doc in sections(model):
        missing += [
            f"{doc.dotted}.{name}"
            for name, field in doc.model.model_fields.items()
            if not (field.description or "").strip()
            and not (_section_of(field.annotation) and (field.annotation.__doc__ or "").strip())
        ]
    return missing


def type_name(annotation: Any) -> str:
    """A reader's name for a field's type: ``integer``, ``"file" | "kafka"``, ``list of string``, ..."""
    if annotation is type(None):
        return "unset"
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return " | ".join(json.dumps(m.value) for m in annotation)
        if issubclass(annotation, Section):
            return "table"
        if issubclass(annotation, SecretStr):
            return "secret string"
        simple = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "table"}
        return simple.get(annotation, annotation.__name__)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" (optional)" if type(None) in args else "")
    if origin is list:
        inner = args[0] if args else Any
        return "list of tables" if _section_of(inner) else f"list of {type_name(inner)}"
    if origin is dict:
        return "table"
    return str(annotation).replace("typing.", "")


def bounds(field: FieldInfo) -> str:
    """The field's constraints as text: ``>= 1, < 65536``, ``pattern ^[a-z]...$``, ``at least 1 item``."""
    out: list[str] = []
    unit = "character" if field.annotation is str else "item"  # min_length of a string counts characters
    for meta in field.metadata:
        if isinstance(meta, annotated_types.Gt):
            out.append(f"> {meta.gt}")
        elif isinstance(meta, annotated_types.Ge):
            out.append(f">= {meta.ge}")
        elif isinstance(meta, annotated_types.Lt):
            out.append(f"< {meta.lt}")
        elif isinstance(meta, annotated_types.Le):
            out.append(f"<= {meta.le}")
        elif isinstance(meta, annotated_types.MultipleOf):
            out.append(f"multiple of {meta.multiple_of}")
        elif isinstance(meta, annotated_types.MinLen):
            out.append(f"at least {meta.min_length} {unit}{'s' if meta.min_length != 1 else ''}")
        elif isinstance(meta, annotated_types.MaxLen):
            out.append(f"at most {meta.max_length} {unit}{'s' if meta.max_length != 1 else ''}")
        elif getattr(meta, "pattern", None):
            out.append(f"pattern `{meta.pattern}`")
    return ", ".join(out)


def toml_value(value: Any) -> str:
    """A default as it would be written in ``hourglass.toml`` (``unset`` for None)."""
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        return json.dumps(value.get_secret_value())
    if isinstance(value, enum.Enum):
        return json.dumps(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, BaseModel):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in _set_values(value).items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _set_values(model: BaseModel) -> dict[str, Any]:
    """The fields a default table sets away from their own defaults (``{fn = "exact_answer"}``)."""
    return {
        name: getattr(model, name)
        for name, field in type(model).model_fields.items()
        if field.is_required() or getattr(model, name) != field.get_default(call_default_factory=True)
    }


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if _section_of(field.annotation) and not _section_of(field.annotation)[1]:  # type: ignore[index]
        return "see below"
    return toml_value(field.get_default(call_default_factory=True))


def prose(docstring: str | None) -> str:
    """A class docstring as one markdown paragraph: reST roles and ````code```` become plain `code`."""
    text = " ".join((docstring or "").split())
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _code(text: str) -> str:
    return f"`{text}`" if text not in ("required", "unset", "see below", "") else text


def env_name(path: tuple[str, ...]) -> str:
    """``("serving", "canary", "fraction")`` → ``HOURGLASS_SERVING__CANARY__FRACTION``."""
    return ENV_PREFIX + "__".join(p.upper() for p in path)


def _table(model: type[BaseModel], path: tuple[str, ...], array: bool) -> str:
    rows = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        nested = _section_of(field.annotation)
        kind = type_name(field.annotation)
        if nested:
            kind = f"[{'array of tables' if nested[1] else 'table'}](#{'-'.join(path + (name,))})"
        limits = bounds(field)
        type_cell = _cell(kind) + (f"; {_cell(limits)}" if limits else "")
        description = field.description or ""
        if not description and nested:  # a table field may rely on its class's docstring
            description = (nested[0].__doc__ or "").strip().splitlines()[0]
        if not array:
            description = f"{description} Environment: `{env_name(path + (name,))}`."
        rows.append(f"| `{name}` | {type_cell} | {_cell(_code(default_text(field)))} | {_cell(description)} |")
    return "\n".join(rows)


def render(model: type[BaseModel] = HourglassConfig) -> str:
    """The whole reference as markdown: the top-level fields, then one section per table, nested ones included."""
    docs = list(sections(model))
    links: dict[type[BaseModel], str] = {}
    for doc in docs:  # a class used at two paths (RewardTerm) links to the first
        links.setdefault(doc.model, doc.anchor)
    out = [
        "## Top level",
        "",
        "The keys outside every section. Environment: `HOURGLASS_<FIELD>`.",
        "",
        "| field | type | default | description |",
        "| --- | --- | --- | --- |",
    ]
    for name, field in model.model_fields.items():
        nested = _section_of(field.annotation)
        if nested:
            first = (nested[0].__doc__ or "").strip().splitlines()[0]
            kind = f"[{'array of tables' if nested[1] else 'table'}](#{name})"
            out.append(f"| `{name}` | {kind} | {_cell(_code(default_text(field)))} | {_cell(first)} |")
        else:
            description = f"{field.description or ''} Environment: `{env_name((name,))}`."
            out.append(
                f"| `{name}` | {_cell(type_name(field.annotation))} | {_cell(_code(default_text(field)))} | {_cell(description)} |"
            )
    for doc in docs:
        level = "#" * min(2 + len(doc.path) - 1, 4)
        out += ["", f"{level} `{doc.heading}` {{#{doc.anchor}}}", ""]
        intro = prose(doc.model.__doc__)
        if intro:
            out += [intro, ""]
        if doc.array:
            out += [
                f"An array of tables: write one `[[{doc.dotted}]]` table per entry. The environment variable "
                f"`{env_name(doc.path)}` replaces the whole list, as JSON.",
                "",
            ]
        if links[doc.model] != doc.anchor:
            out += [f"The same fields as [`{_heading_of(docs, links[doc.model])}`](#{links[doc.model]}).", ""]
            continue
        out.append(_table(doc.model, doc.path, doc.array or _in_array(docs, doc)))
    return "\n".join(out) + "\n"


def _heading_of(docs: list[SectionDoc], anchor: str) -> str:
    return next(d.heading for d in docs if d.anchor == anchor)


def _in_array(docs: list[SectionDoc], doc: SectionDoc) -> bool:
    """True when a parent of ``doc`` is an array of tables (its fields have no variable of their own)."""
    return any(d.array and doc.path[: len(d.path)] == d.path and d.path != doc.path for d in docs)


def expand(markdown: str) -> str:
    """``markdown`` with :data:`MARKER` replaced by :func:`render`'s reference.

    Raises:
        ValueError: the page has no marker (the reference would silently vanish from the site).
    """
    if MARKER not in markdown:
        raise ValueError(f"the configuration page has no {MARKER} marker")
    return markdown.replace(MARKER, render())


# --- the commented example config ------------------------------------------------------------------

EXAMPLE_HEADER = """\
# Hourglass configuration reference: every field of hourglass.toml, with its default and what it does.
# Generated from the config classes (`python -m pipeline.config_reference > deploy/reference.toml`);
# tests/pipeline/test_config_reference.py checks that it is current and that it loads to the defaults.
# Copy the tables you change into your own file; deploy/hourglass.toml (the embedded default),
# deploy/production.toml and deploy/demo.toml are worked examples. Any field can be overridden with
# HOURGLASS_<SECTION>__<FIELD> (nested with __, e.g. HOURGLASS_RL__GATE__METRIC).
"""


def _comment(text: str | None, width: int = 100) -> list[str]:
    import textwrap

    return [f"# {line}" for line in textwrap.wrap(prose(text), width - 2)] if text else []


def _emit(model: type[BaseModel], value: BaseModel | None, path: tuple[str, ...], out: list[str]) -> None:
    """The keys of one table (plain keys first, as TOML needs), then its subtables, depth first."""
    subtables = []
    for name, field in model.model_fields.items():
        current = getattr(value, name) if value is not None else field.get_default(call_default_factory=True)
        nested = _section_of(field.annotation)
        if nested:
            subtables.append((name, field, nested, current))
            continue
        out += _comment(field.description)
        out.append(f"# {name} =  (unset)" if current is None else f"{name} = {toml_value(current)}")
    for name, field, (cls, array), current in subtables:
        dotted = ".".join(path + (name,))
        entries = list(current or []) if array else [current]
        for entry in entries or [None]:
            out += ["", f"[[{dotted}]]" if array else f"[{dotted}]"]
            about = _comment(field.description or cls.__doc__)
            out += about
            if array and entry is None:
                out[-1 - len(about)] = f"# [[{dotted}]]  (none by default)"
                continue
            _emit(cls, entry, path + (name,), out)


def example_toml(model: type[BaseModel] = HourglassConfig) -> str:
    """``hourglass.toml`` with every field at its default, each under its description (deploy/reference.toml)."""
    out = [EXAMPLE_HEADER]
    _emit(model, None, (), out)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(example_toml(), end="")
