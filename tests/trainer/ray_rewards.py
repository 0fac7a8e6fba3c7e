"""Reward functions the Ray tests name as ``ray_rewards:<fn>``: importable by trainer actors
(the ``ray_cluster`` fixture puts this folder on their ``PYTHONPATH``)."""

from __future__ import annotations


def no_newline(prompt_messages, completion: str, metadata) -> float:
    """1 - newlines per completion token slot (4 tokens): the peaked tiny model's base answers
    are all newlines (0.0), so any candidate that moves away from them scores higher."""
    return 1.0 - completion.count("\n") / 4
