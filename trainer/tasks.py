"""Verifiable prompts from reasoning-gym tasks (offline, seeded): a source of training prompts with
trusted reference answers, for demos, tests and benchmarks."""

from __future__ import annotations

from typing import Any

from trainer.types import Prompt

ANSWER_ONLY = "Answer with the number only."


def reasoning_gym_prompts(
    task: str = "basic_arithmetic", n: int = 32, seed: int = 0, *, instruction: str = ANSWER_ONLY, **task_kwargs: Any
) -> list[Prompt]:
    """``n`` verifiable chat prompts from a reasoning-gym task (offline, seeded).

    Each prompt is one user message (question + ``instruction``) with
    ``metadata["reference_answer"]`` = reasoning-gym's answer string.
    Example: ``reasoning_gym_prompts("basic_arithmetic", 16, min_terms=2,
    max_terms=2, min_digits=1, max_digits=1)``.
    """
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, size=n, seed=seed, **task_kwargs)
    prompts = []
    for i, item in enumerate(dataset):
        content = f"{item['question']} {instruction}".strip()
        prompts.append(
            Prompt(
                prompt_id=f"{task}-{seed}-{i}",
                messages=[{"role": "user", "content": content}],
                metadata={"reference_answer": str(item["answer"]), "task": task},
            )
        )
    return prompts
