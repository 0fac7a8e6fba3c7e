"""Rollouts and evaluation spread over a fleet of vLLM replicas.

Placement rule: candidates go round-robin over the replicas in the order they
are first loaded (the round loads them in config order, then the champions it
evaluates), or in an explicit ``order``: candidate ``i`` -> replica ``i mod N``.
So every replica gets work, and all requests of one candidate (its GRPO
groups, every step's version, its evaluation answers) stay on one replica,
whose prefix cache then holds that candidate's prompts. Requests to the base
model (on every replica) are spread by ``sha256(prompt_id) mod N``, so the
same prompt meets the same cache. Several trainer processes of one round
(e.g. Ray actors, each with its own engine) are given the round's whole
candidate order, so candidate ``i`` meets replica ``i mod N`` whichever
process trains it.

Each replica is a :class:`trainer.rollout.vllm.VLLMEngine`; a version is loaded
only on its candidate's replica. One :meth:`FleetEngine.generate` call sends
every replica its share at once (one event loop), so each replica still
batches all the adapters it holds in one engine step.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from pathlib import Path

from trainer.errors import RolloutError
from trainer.types import BASE_VERSION, RolloutRequest
from trainer.rollout.vllm import VLLMEngine
from trainer.types import Sample


def _bucket(text: str, n: int) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % n


class FleetEngine:
    """A rollout engine over several vLLM servers (see the module docstring for the placement rule).

    Args:
        urls: the replicas' base URLs (at least one), e.g. ``serving.replicas``.
        order: candidate names in placement order; names not in it are appended when first loaded.
        adapter_share: a shared adapter store URI (see :class:`VLLMEngine`); None: replicas read adapter paths.
        **engine_kwargs: passed to each :class:`VLLMEngine` (``base_name``, ``timeout_s``, ...).

    Raises:
        RolloutError: no URL given.
    """

    def __init__(
        self, urls: Sequence[str], *, order: Sequence[str] = (), adapter_share: str | None = None, **engine_kwargs
    ) -> None:
        urls = list(dict.fromkeys(u.rstrip("/") for u in urls))
        if not urls:
            raise RolloutError("a vLLM fleet needs at least one replica URL (serving.replicas or rl.rollout.urls)")
        self.engines = [VLLMEngine(u, adapter_share=adapter_share, **engine_kwargs) for u in urls]
        self.base_name = self.engines[0].base_name
        self.order = list(order)
        self.versions: dict[str, str] = {}  # version -> candidate
        self.last_load_s = 0.0
        self._requests = [0] * len(self.engines)  # requests sent to each replica by generate()

    def requests_per_replica(self) -> list[int]:
        """Requests :meth:`generate` sent to each replica so far, in ``urls`` order (one request asks ``n`` samples)."""
        return list(self._requests)

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def replica_of(self, candidate: str) -> int:
        """The replica index that holds ``candidate``'s versions (placed now when it is new)."""
        if candidate not in self.order:
            self.order.append(candidate)
        return self.order.index(candidate) % len(self.engines)

    def _engine_for(self, req: RolloutRequest) -> int:
        if req.version == self.base_name:
            return _bucket(req.prompt_id, len(self.engines))
        try:
            return self.replica_of(self.versions[req.version])
        except KeyError:
            raise RolloutError(f"version {req.version!r} is not loaded; loaded: {sorted(self.versions)}") from None

    def load(self, candidate: str, version: str, adapter_dir: Path) -> None:
        """Load ``version`` on ``candidate``'s replica only.

        Raises:
            RolloutError: already loaded, or the replica refused it.
        """
        if version in self.versions or version == self.base_name:
            raise RolloutError(f"version {version!r} is already loaded; publish updates under a new name")
        engine = self.engines[self.replica_of(candidate)]
        engine.load(candidate, version, adapter_dir)
        self.last_load_s = engine.last_load_s
        self.versions[version] = candidate

    def unload(self, version: str) -> None:
        """Unload ``version`` from its replica."""
        if version not in self.versions:
            raise RolloutError(f"version {version!r} is not loaded here; loaded: {sorted(self.versions)}")
        self.engines[self.replica_of(self.versions[version])].unload(version)
        del self.versions[version]

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[Sample]]:
        """Every request at once, each on its replica; ``n`` samples each, in request order.

        Raises:
            RolloutError: an unknown version, or a replica's error (see :meth:`VLLMEngine.generate`).
        """
        shares: dict[int, list[int]] = {}
        for i, req in enumerate(requests):
            shares.setdefault(self._engine_for(req), []).append(i)
        for index, positions in shares.items():
            self.engines[index].check([requests[i] for i in positions])
        for index, positions in shares.items():
            self._requests[index] += len(positions)

        async def _all() -> list[list[list[Sample]]]:
            return list(
                await asyncio.gather(
                    *(self.engines[k]._generate_all([requests[i] for i in pos]) for k, pos in shares.items())
                )
            )

        out: list[list[Sample] | None] = [None] * len(requests)
        for positions, groups in zip(shares.values(), asyncio.run(_all()), strict=True):
            for i, samples in zip(positions, groups, strict=True):
                out[i] = samples
        return out  # type: ignore[return-value]

    def placement(self) -> dict[str, str]:
        """``{loaded version: replica URL}`` (for logs and tests)."""
        return {v: self.engines[self.replica_of(c)].url for v, c in self.versions.items()}


def make_vllm_engine(urls: Sequence[str], *, order: Sequence[str] = (), adapter_share: str | None = None):
    """One :class:`VLLMEngine` for one URL, a :class:`FleetEngine` for several."""
    urls = list(dict.fromkeys(u.rstrip("/") for u in urls))
    if len(urls) == 1:
        return VLLMEngine(urls[0], adapter_share=adapter_share)
    return FleetEngine(urls, order=order, adapter_share=adapter_share)


__all__ = ["BASE_VERSION", "FleetEngine", "make_vllm_engine"]
