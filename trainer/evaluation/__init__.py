"""Held-out evaluation of every candidate and champion, and the gate (:mod:`.evaluate`)."""
