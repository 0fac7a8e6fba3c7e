"""How a candidate learns: the losses (:mod:`.losses`), its batches and its update step (:mod:`.update`)."""
