"""The gateway: an OpenAI-compatible proxy in front of vLLM (:mod:`.app`), its
request checks (:mod:`.request`), trace building (:mod:`.trace`), event
publishing (:mod:`.events`) and API keys, limits and feedback tokens (:mod:`.auth`)."""
