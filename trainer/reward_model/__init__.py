"""The reward model learned from users' feedback: the adapter + scalar head, its training and evaluation
(:mod:`.model`), and its part of a round (:mod:`.phase`)."""
