"""``python -m pipeline.demo``: run the demo (see :mod:`pipeline.demo.main`)."""

import typer

from pipeline.demo.main import main

typer.run(main)
