"""The regression suites Hourglass ships (``path = "shipped:<name>"`` in ``[[rl.regression]]``), and how
each file was made: ``python -m trainer.evaluation.shipped_suites`` writes them again, byte for byte
(``tests/trainer/test_regression.py`` checks the committed files are current).

``reasoning-gym-mix``: 64 short-answer prompts from reasoning-gym tasks other than the demo's arithmetic
(logic, family relations, counting, word manipulation, retrieval), seeded, an equal number per task,
interleaved; each asks for the answer first, so its check is ``short_answer``
(:func:`trainer.rewards.short_answer`). What a served model could do before it learned from its users,
and must still do after.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from trainer.evaluation.regression import SHIPPED_DIR

REASONING_GYM_MIX = "reasoning-gym-mix"
SEED = 2812  # issue 28, item 1
PROMPTS = 64
INSTRUCTION = "Give the answer first, on its own line."

# task -> reasoning-gym settings: small instances, short answers (Yes/No, a word, a number, a short list)
TASKS: dict[str, dict[str, Any]] = {
    "syllogism": {},
    "family_relationships": {},
    "letter_counting": {"min_words": 3, "max_words": 5},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "max_instances": 3},
    "needle_haystack": {"min_num_statements": 3, "max_num_statements": 6},
    "word_sequence_reversal": {"min_words": 3, "max_words": 4},
    "spell_backward": {"min_word_len": 3, "max_word_len": 4},
    "number_format": {"min_num_candidates": 2, "max_num_candidates": 3, "min_n": 1, "max_n": 100},
}


def reasoning_gym_mix(n: int = PROMPTS, seed: int = SEED) -> list[dict[str, Any]]:
    """``n`` suite lines (``{id, messages, metadata}``), round-robin over :data:`TASKS`, seeded."""
    import reasoning_gym

    per_task = -(-n // len(TASKS))
    items = {
        task: list(reasoning_gym.create_dataset(task, size=per_task, seed=seed, **kwargs))
        for task, kwargs in TASKS.items()
    }
    lines = []
    for i in range(per_task):
        for task in TASKS:
            item = items[task][i]
            lines.append(
                {
                    "id": f"{task}-{i}",
                    "messages": [{"role": "user", "content": f"{item['question'].strip()}\n{INSTRUCTION}"}],
                    "metadata": {"reference_answer": str(item["answer"]), "task": task},
                }
            )
    return lines[:n]


def write(folder: Path = SHIPPED_DIR) -> Path:
    """Write ``reasoning-gym-mix.jsonl`` into ``folder``; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{REASONING_GYM_MIX}.jsonl"
    out.write_text("".join(json.dumps(line, ensure_ascii=False, sort_keys=True) + "\n" for line in reasoning_gym_mix()))
    return out


if __name__ == "__main__":
    sys.stdout.write(f"{write()}\n")
