"""Where candidates' LoRA weights and AdamW state wait between their turns: the :class:`~.store.AdapterStore`
Protocol, its two stores (:mod:`.resident`, :mod:`.offload`) by name (:mod:`.registry`), the LoRA tensor helpers
they share (:mod:`.lora_tensors`), and the shared adapter folder vLLM replicas fetch from (:mod:`.share`)."""
