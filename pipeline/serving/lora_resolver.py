"""A vLLM LoRA resolver plugin: a replica fetches adapters it is asked for from the shared adapter store.

Why: in a fleet, vLLM replicas do not share a disk with the service or the
trainers, so ``POST /v1/load_lora_adapter {"lora_path": ...}`` with a path on
the service's disk cannot work. Instead the writer publishes the verified
adapter folder to a store every party can read
(:func:`trainer.adapters.share.publish`, a ``pyarrow.fs`` URI: ``s3://``,
``gs://`` or a path), and the first request that names the adapter makes the
replica fetch it.

Upstream mechanism (vLLM 0.32, ``vllm.lora.resolver``): with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, a request whose ``model`` is neither
the base nor a loaded adapter is handed to every registered
``LoRAResolver``; the first that returns a ``LoRARequest`` has it loaded
(under a per-name lock, so concurrent requests load it once). Resolvers are
registered by plugins of the ``vllm.general_plugins`` entry-point group, which
vLLM calls in each of its processes; ``pyproject.toml`` declares
:func:`register` there.

Replica settings (environment of the vLLM process):

- ``HOURGLASS_ADAPTER_SHARE``: the store's URI (the service's
  ``serving.adapter_share_uri``). Unset: the plugin registers nothing.
- ``HOURGLASS_ADAPTER_CACHE``: the replica's local folder for fetched copies
  (default ``<tmp>/hourglass-adapters``).
- ``HOURGLASS_ADAPTER_CACHE_KEEP``: how many fetched folders stay cached
  (default 64; older ones are removed before a new fetch).

vLLM's built-in filesystem resolver (``VLLM_LORA_RESOLVER_CACHE_DIR``) only
reads a folder on the replica's own disk, which is the shared disk this plugin
exists to avoid; the hub resolver needs the Hugging Face Hub.

Each fetch checks every file against the manifest the writer published
(sha256), so a torn or corrupted copy is refused (the request gets vLLM's
404) rather than loaded. Only the service and trainers may write the store:
what is in it is served.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile

from pipeline.errors import ConfigError
from trainer.adapters.share import AdapterShareError, evict, fetch

# A child of the "vllm" logger, so the line lands in the vLLM server log.
log = logging.getLogger("vllm.plugins.hourglass.resolver")

ENV_SHARE = "HOURGLASS_ADAPTER_SHARE"
ENV_CACHE = "HOURGLASS_ADAPTER_CACHE"
ENV_KEEP = "HOURGLASS_ADAPTER_CACHE_KEEP"
RESOLVER_NAME = "hourglass-adapter-share"


def make_resolver(share_uri: str, cache_dir: str, keep: int = 64):
    """A ``vllm.lora.resolver.LoRAResolver`` that fetches ``<share_uri>/<lora_name>/`` into ``cache_dir``."""
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver

    class AdapterShareResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
            def _fetch():
                evict(cache_dir, keep)
                return fetch(share_uri, lora_name, cache_dir)

            try:
                path = await asyncio.to_thread(_fetch)
            except (AdapterShareError, OSError) as err:
                log.warning("hourglass resolver: not loading %r: %s", lora_name, err)
                return None
            if path is None:
                return None
            log.info("hourglass resolver: fetched %r from %s into %s", lora_name, share_uri, path)
            return LoRARequest(
                lora_name=lora_name, lora_int_id=abs(hash(lora_name)) % (1 << 30) + 1, lora_path=str(path)
            )

    return AdapterShareResolver()


def register() -> None:
    """vLLM plugin entry point: register the resolver when ``HOURGLASS_ADAPTER_SHARE`` is set (idempotent).

    Raises:
        ConfigError: ``HOURGLASS_ADAPTER_CACHE_KEEP`` is not a whole number >= 1 (vLLM then fails to start,
            with this message in its log, rather than evicting every adapter it fetched).
    """
    share = os.environ.get(ENV_SHARE, "").strip()
    if not share:
        return
    raw_keep = os.environ.get(ENV_KEEP, "64").strip()
    if not raw_keep.isdigit() or int(raw_keep) < 1:  # 0 or less would evict every fetched adapter at each fetch
        raise ConfigError(f"{ENV_KEEP}={raw_keep!r} must be a whole number of adapters, at least 1 (default 64)")
    keep = int(raw_keep)
    from vllm.lora.resolver import LoRAResolverRegistry

    if RESOLVER_NAME in LoRAResolverRegistry.get_supported_resolvers():
        return
    cache = os.environ.get(ENV_CACHE) or os.path.join(tempfile.gettempdir(), "hourglass-adapters")
    os.makedirs(cache, exist_ok=True)
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, make_resolver(share, cache, keep))
    log.info("hourglass resolver: adapters from %s, cached in %s", share, cache)
