"""Canary promotion: a round's winner serves a slice of live traffic as ``@challenger``
and is promoted or aborted on live user feedback (:mod:`.sequential` decides,
:mod:`.monitor` gathers the evidence and acts, :mod:`.state` moves the aliases)."""
