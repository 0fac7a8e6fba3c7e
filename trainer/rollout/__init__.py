"""Rollout engines: the :class:`~.engine.RolloutEngine` Protocol, transformers (:mod:`.hf`), a vLLM server
(:mod:`.vllm`) and a fleet of them (:mod:`.fleet`)."""
