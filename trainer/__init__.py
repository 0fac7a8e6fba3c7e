"""Learning: the resident base model, the adapter store, rollout engines,
reward functions, RL losses, the multi-LoRA round and evaluation."""
