"""mkdocs hook: the operations page's canary sample-size tables are rendered from the canary's own formula.

``docs/operations.md`` holds the marker ``<!-- canary-sizing -->``; this hook replaces it with
:func:`pipeline.canary.sizing.render` (the production defaults of ``[serving.canary]`` and the demo's
``deploy/demo.toml``), so the tables cannot drift from the test or the settings. A page without the
marker fails the build.
"""

from __future__ import annotations

from typing import Any

from pipeline.canary.sizing import render

PAGE = "operations.md"
MARKER = "<!-- canary-sizing -->"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its {MARKER} marker: the canary sizing tables have nowhere to go")
    return markdown.replace(MARKER, render())
