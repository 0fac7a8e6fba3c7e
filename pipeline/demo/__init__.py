"""The demo (``python -m pipeline.demo``): the whole loop on this machine with
simulated users. Outside the library's import graph: it imports the library,
nothing in ``pipeline``, ``connectors`` or ``trainer`` imports it."""
