"""The registry's outbox: registrations written ahead to local disk, so that nothing is lost while MLflow
is unreachable, and registered once it answers. One mechanism for both kinds of registration:

- :data:`ROUNDS`: a round and its winners' adapters, ``<state_dir>/registry/pending/<round_id>/``
  (``round.json`` + ``adapters/<candidate>/``), :mod:`pipeline.registry.models`;
- :data:`REWARD_MODELS`: a round's reward model, ``<state_dir>/registry/pending-reward/<round_id>/``
  (``reward.json`` + ``files/``), :mod:`pipeline.registry.reward_registry`.

An entry is one folder, written atomically (:func:`connectors.atomic.new_dir`: its record and copies of
its files appear together, or not at all) and removed only once MLflow holds everything. An entry
that already exists is kept as it is (a retry of the same round writes nothing new). Entries are
processed oldest first; every registration step is idempotent by the round id tag
(:func:`pipeline.registry.client.find_round_version`), so a retry never registers a version twice.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connectors import atomic
from pipeline.config import HourglassConfig


@dataclass(frozen=True)
class Box:
    """One kind of pending registration: its folder under ``<state_dir>/registry`` and its record's file name."""

    folder: str
    record: str


ROUNDS = Box("pending", "round.json")
REWARD_MODELS = Box("pending-reward", "reward.json")


class Outbox:
    """The entries of one :class:`Box` of this deployment."""

    def __init__(self, cfg: HourglassConfig, box: Box) -> None:
        self.root = cfg.resolve(cfg.state_dir) / "registry" / box.folder
        self.box = box

    def entry(self, round_id: str) -> Path:
        """The folder of ``round_id``'s entry (it may not exist)."""
        return self.root / round_id

    def put(self, round_id: str, record: dict[str, Any], folders: Mapping[str, Path] = {}) -> Path:
        """Write ``round_id``'s entry: ``record`` as JSON and a copy of each of ``folders`` under its name
        (``{"adapters/a": path}``), atomically. An entry that exists is kept as it is. Returns its folder.

        ``record`` may name the copies by their final place (:meth:`entry` / name).
        """
        final = self.entry(round_id)
        if (final / self.box.record).is_file():
            return final
        with atomic.new_dir(final) as built:
            for name, source in folders.items():
                shutil.copytree(source, built / name, symlinks=False)
            (built / self.box.record).write_text(json.dumps(record, indent=2, default=str))
        return final

    def read(self, round_id: str) -> dict[str, Any] | None:
        """``round_id``'s record, or None when it has no entry."""
        path = self.entry(round_id) / self.box.record
        return json.loads(path.read_text()) if path.is_file() else None

    def pending(self) -> list[str]:
        """The round ids with an entry, oldest first."""
        if not self.root.is_dir():
            return []
        folders = [p for p in self.root.iterdir() if (p / self.box.record).is_file()]
        return [p.name for p in sorted(folders, key=lambda p: p.stat().st_mtime)]

    def done(self, round_id: str) -> None:
        """Remove ``round_id``'s entry: MLflow holds all of it."""
        shutil.rmtree(self.entry(round_id), ignore_errors=True)
