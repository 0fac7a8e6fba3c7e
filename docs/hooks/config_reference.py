"""mkdocs hook: the configuration page's reference is rendered from the config classes at build time.

``docs/configuration.md`` holds the marker ``<!-- config-reference -->``; this hook replaces it with
:func:`pipeline.config_reference.render`, the tables of every section's fields (type, bounds,
default, description, environment variable) read from the pydantic models, so the page cannot
drift from the code. A page without the marker fails the build.
"""

from __future__ import annotations

from typing import Any

from pipeline.config_reference import expand

PAGE = "configuration.md"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    return expand(markdown)
