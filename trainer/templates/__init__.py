"""Chat templates Hourglass ships, and where a ``model.chat_template`` setting points.

A setting is a built-in name (:data:`BUILTIN_TEMPLATES`), a path to a Jinja file, or unset (the model
folder's own template). The trainer renders prompts with it and the embedded vLLM is started with the same
file (``--chat-template``), so the served and the trained rendering are one.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent
CHATML_TOOLS = "chatml-tools"  # the built-in ChatML template with Hermes-style tools (vLLM's `hermes` parser)
BUILTIN_TEMPLATES = {CHATML_TOOLS: TEMPLATES / "chatml_tools.jinja"}


def template_path(choice: str | None) -> Path | None:
    """The Jinja file of a ``model.chat_template`` setting: a built-in name (:data:`BUILTIN_TEMPLATES`), a path
    to a file, or None (the model folder's own template)."""
    if not choice:
        return None
    return BUILTIN_TEMPLATES.get(choice, Path(choice).expanduser())
