"""Names and tags that look like Rich markup are printed as text by the CLI tables, never parsed.

A model name given on the command line (``hourglass canary status --model '[/x]'``) or an MLflow tag that
anyone with MLflow access can write (``hourglass.serve_error``) made Rich raise MarkupError: a traceback
instead of the table.
"""

from __future__ import annotations

import io

from rich.console import Console

from pipeline.cli.canary import status_table
from pipeline.cli.ops import _round_table
from pipeline.cli.registry import _table as models_table

HOSTILE = "[/x] [bold]b[/bold] [link=http://evil]"


def _render(table) -> str:
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(table)
    return out.getvalue()


def test_canary_status_prints_a_markup_model_name_and_reason_as_text() -> None:
    view = {
        "version": "4",
        "champion_version": "3",
        "fraction": 0.2,
        "started_at": None,
        "challenger": {"n": 2, "mean": 0.5},
        "champion": {"n": 1, "mean": 0.0},
        "lower": -0.5,
        "upper": 0.9,
        "decision": "continue",
        "reason": HOSTILE,
    }
    text = _render(status_table({HOSTILE: {"canary": None}, "hg": {"canary": view}}))
    assert text.count(HOSTILE) == 2 and "no canary" in text and "v4" in text


def test_models_list_prints_markup_tags_as_text() -> None:
    data = {
        "models": [
            {
                "model": "hg",
                "versions": [
                    {
                        "version": "2",
                        "aliases": ["champion"],
                        "tags": {"hourglass.round_id": "[/r]", "hourglass.serve_error": HOSTILE},
                    }
                ],
            }
        ],
        "replicas": {"http://127.0.0.1:1": "[/served]"},
    }
    text = _render(models_table(data))
    assert "[/r]" in text and HOSTILE in text and "[/served]" in text


def test_rounds_list_marks_a_candidate_that_sat_the_round_out() -> None:
    """``hourglass rounds list``: the requested candidates, the ones that sat the round out marked (the
    reason is ``rounds show``'s); a hand-edited ``skipped`` that is not a mapping marks nothing."""
    record = {
        "round_id": "r1",
        "state": "done",
        "trigger": "api",
        "candidates": ["default", "grpo-rm"],
        "window": "1h",
        "created_at": "2026-12-05T21:00:00",
        "reason": HOSTILE,
    }
    text = _render(
        _round_table([record | {"skipped": {"grpo-rm": "no reward model this round"}}, record | {"skipped": ["x"]}])
    )
    lines = [line for line in text.splitlines() if "r1" in line]
    assert "default,grpo-rm (sat out)" in lines[0] and HOSTILE[:40] in lines[0]
    assert "default,grpo-rm " in lines[1] and "(sat out)" not in lines[1]
    edited = {"round_id": "[/x]", "state": "[/]", "trigger": None, "candidates": [1, None], "reason": 5}
    assert "[/x]" in _render(_round_table([edited]))  # a record edited by hand: text, not a MarkupError
