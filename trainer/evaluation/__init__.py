"""Held-out evaluation and the gate: the evaluate phase (:mod:`.evaluate`), its measurements (:mod:`.measure`),
the gate metrics by name (:mod:`.metrics`), their statistics (:mod:`.stats`) and the pure gate (:mod:`.gate`)."""
