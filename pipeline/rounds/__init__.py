"""Rounds: the round driver, snapshot to promotion (:mod:`.job`), and the
persisted round records and their store (:mod:`.records`)."""
