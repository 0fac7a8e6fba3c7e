"""``python -m pipeline.cli``: the ``hourglass`` command line."""

from pipeline.cli.main import main

main()
