"""Helpers of the Ray tests: a reward trainer actors import by name
(``tests.trainer.ray_helpers:no_newline``; the ``ray_cluster`` fixture puts the repository
on their ``PYTHONPATH``) and what a cluster still holds after a round."""

from __future__ import annotations

import time


def no_newline(prompt_messages, completion: str, metadata) -> float:
    """1 - newlines per completion token slot (4 tokens): the peaked tiny model's base answers
    are all newlines (0.0), so any candidate that moves away from them scores higher."""
    return 1.0 - completion.count("\n") / 4


def leftovers() -> tuple[list[str], list[str]]:
    """Live actors (class names) and placement groups (names) of the cluster, from its GCS tables
    (the state API needs the dashboard, which the ``ray_cluster`` fixture leaves out)."""
    import ray
    from ray._private import state

    actors = [a["ActorClassName"] for a in state.actors().values() if a["State"] != "DEAD"]
    groups = [g["name"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    return actors, groups


def until_clean(timeout_s: float = 20.0) -> tuple[list[str], list[str]]:
    """:func:`leftovers` once it is empty, or what is left after ``timeout_s`` (a kill takes effect asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (left := leftovers()) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def longer(prompt_messages, completion: str, metadata) -> float:
    """Characters per completion (scaled): on a random model, samples of one group differ in length,
    so GRPO always has a signal."""
    return len(completion) / 40


def unlike_base(prompt_messages, completion: str, metadata) -> float:
    """1.0 when the answer differs from the base model's greedy answer in ``metadata["base_answer"]``:
    a yardstick any trained candidate beats the base on (for tests of a round's plumbing, not of learning)."""
    return float(completion != metadata["base_answer"])


unlike_base.required_metadata = ("base_answer",)  # type: ignore[attr-defined]
