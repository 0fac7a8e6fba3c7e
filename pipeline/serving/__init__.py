"""Serving control: the reconcile loop (:mod:`.controller`) and its canary step (:mod:`.challenger`), staging and
verification of a version (:mod:`.staging`), the vLLM replicas (:mod:`.replica`)
and the vLLM CPU LoRA plugin (:mod:`.vllm_cpu_lora`, loaded by vLLM itself).

Kept import-free: vLLM imports the plugin module in each of its processes."""
