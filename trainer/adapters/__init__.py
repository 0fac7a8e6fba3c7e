"""Where candidates' LoRA weights and AdamW state wait between their turns: the :class:`~.store.AdapterStore`
Protocol and :func:`~.store.make_store`, its two stores (:mod:`.resident`, :mod:`.offload`), the LoRA tensor helpers
they share (:mod:`.lora_tensors`), and the shared adapter folder vLLM replicas fetch from (:mod:`.share`)."""
