"""The resident base model: loading and wrapping it (:mod:`.base`), packaged base models and their
fingerprints (:mod:`.store`), and completion log-probs with each distinct prompt run once (:mod:`.logprobs`)."""
