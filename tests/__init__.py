"""Hourglass's tests, one folder per package of the code (``tests/pipeline/serving`` tests
``pipeline/serving``), plus ``tests/deploy`` (deployment files, locks) and ``tests/e2e`` (the whole loop).

Every test folder is a package, so test files may share a basename across folders and helpers are
imported by their full name (``from tests.pipeline.serving_helpers import make_config``).
"""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the repository root (deploy/, pyproject.toml, ...)
