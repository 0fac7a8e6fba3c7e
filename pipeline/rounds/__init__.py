"""Rounds: the round driver, snapshot to promotion (:mod:`.job`), what each state does
(:mod:`.steps`), and the persisted round records, their states and their store (:mod:`.records`)."""
