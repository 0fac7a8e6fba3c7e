"""Secrets the embedded deployment keeps in its state folder, each created once (mode 0600) on first use:
the ops API's bearer token (``<state_dir>/api-token``) and the registry's signing key
(``<state_dir>/signing-key``, :func:`pipeline.registry.signing.signing_keys`).

A production deployment sets both in the environment instead (:func:`pipeline.config.secret_problems`
refuses to start without them). A leaf of the library: the service, the CLI and the demo read the token
here, so none of them imports another for it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

from pipeline.config import HourglassConfig

API_TOKEN_FILE = "api-token"


def state_secret(path: Path, make: Callable[[], str] = lambda: secrets.token_urlsafe(32)) -> str:
    """The secret in ``path``; on first use ``make()`` (default: 32 random bytes as URL-safe text) is written
    there with mode 0600.

    Two processes creating it at once agree on one secret (the file is created exclusively; the loser
    reads the winner's).
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # created concurrently by another process
            pass
        else:
            with os.fdopen(fd, "w") as handle:
                handle.write(make())
    return path.read_text().strip()


def api_token(cfg: HourglassConfig) -> str:
    """``api.token`` when set; else the token in ``<state_dir>/api-token`` (created 0600 on first use)."""
    if cfg.api.token is not None:
        return cfg.api.token.get_secret_value()
    return state_secret(cfg.resolve(cfg.state_dir) / API_TOKEN_FILE)
