"""Learning: one round of multi-LoRA RL on a resident base model.

Rooms (each a subpackage; :mod:`tests.test_import_graph` checks they import each other downwards only):
``model`` (the resident base), ``adapters`` (where candidates' LoRA weights wait), ``rollout`` (engines),
``algorithms`` (losses and updates), ``multi_lora`` (all candidates in one forward/backward),
``reward_model`` (learned from feedback), ``evaluation`` (held-out evaluation and the gate),
``executors`` (where candidates train: here, or on Ray). At the top: the vocabulary of a round
(:mod:`trainer.types`), its config, data, plan, and the round itself (:mod:`trainer.round`).
"""
