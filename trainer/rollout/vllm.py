"""Rollouts from a vLLM OpenAI-compatible server with runtime LoRA loading.

Upstream API (vLLM ``entrypoints/openai``):
- ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and
  ``POST /v1/unload_lora_adapter {"lora_name"}`` (server started with
  ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``);
- ``POST /v1/completions`` with ``prompt`` as token ids, ``n`` samples,
  ``logprobs`` (the sampled token's natural-log probability comes back in
  ``choices[i].logprobs.token_logprobs``) and ``return_token_ids`` (the
  completion token ids in ``choices[i].token_ids``).

All requests of a :meth:`VLLMEngine.generate` call are in flight together
(``asyncio`` + ``httpx.AsyncClient``), so vLLM batches every candidate's
adapter in one engine step (multi-LoRA batching). Requests that differ only
in their prompt travel as one ``/v1/completions`` call whose ``prompt`` is a
list of token-id lists (at most ``max_prompts_per_request`` prompts), and at
most ``max_in_flight`` calls are open at once, so the HTTP client's own work
stays small next to the server's. Each update is loaded under
a new name; old names are unloaded, never reloaded in place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from trainer.errors import RolloutError, TrainerConfigError
from trainer.types import BASE_VERSION, RolloutRequest
from trainer.types import Sample


class VLLMEngine:
    """A vLLM server as a rollout engine.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:8000``.
        base_name: the server's ``--served-model-name`` of the base model.
        timeout_s: per-request timeout, seconds.
        max_in_flight: cap on concurrent HTTP requests (an ``asyncio.Semaphore``
            of this size; the connection pool has as many connections, so it never queues).
        max_prompts_per_request: at most this many prompts per ``/v1/completions``
            call; requests that share version, ``n``, ``max_new_tokens``,
            ``temperature`` (and ``seed`` when sent) are batched into one call.
        per_request_seed: send each request's ``seed`` (reproducible sampling);
            off by default because the vLLM CPU engine crashes on seeded
            requests under chunked prefill.
        adapter_share: a shared adapter store URI (:mod:`trainer.adapters.share`)
            for a server that does not share this host's disk: :meth:`load`
            publishes the folder there and a one-token completion through the
            new name makes the server fetch it (its resolver plugin,
            :mod:`pipeline.serving.lora_resolver`). None: the server reads the local path.

    Raises:
        TrainerConfigError: ``max_in_flight`` or ``max_prompts_per_request`` < 1.
    """

    def __init__(
        self,
        url: str,
        *,
        base_name: str = BASE_VERSION,
        timeout_s: float = 300.0,
        max_in_flight: int = 64,
        max_prompts_per_request: int = 32,
        per_request_seed: bool = False,
        adapter_share: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.adapter_share = adapter_share
        # Per-request seeds crash the vLLM 0.32 CPU engine when a seeded request
        # is chunk-prefilled ("CPU Generator does not use offset", EngineDeadError),
        # taking serving down with it; send them only where the engine supports it.
        self.per_request_seed = per_request_seed
        self.base_name = base_name
        self.timeout_s = timeout_s
        if max_in_flight < 1 or max_prompts_per_request < 1:
            raise TrainerConfigError(
                f"max_in_flight ({max_in_flight}) and max_prompts_per_request ({max_prompts_per_request}) must be >= 1"
            )
        self.max_in_flight = max_in_flight
        self.max_prompts_per_request = max_prompts_per_request
        self.versions: dict[str, str] = {}  # version -> candidate
        self.last_load_s = 0.0

    # -- adapters -------------------------------------------------------------
    def _post(self, path: str, body: dict) -> httpx.Response:
        try:
            response = httpx.post(f"{self.url}{path}", json=body, timeout=self.timeout_s)
        except httpx.HTTPError as err:
            raise RolloutError(f"vLLM at {self.url} unreachable for {path}: {err}; is the server up?") from err
        if response.status_code != 200:
            raise RolloutError(f"vLLM {path} {body} answered {response.status_code}: {response.text[:300]}")
        return response

    def load(self, candidate: str, version: str, adapter_dir: Path) -> None:
        """Load a PEFT folder under a new name.

        Raises:
            RolloutError: the name is already loaded (never reload in place),
                or vLLM refused the adapter.
        """
        if version in self.versions or version == self.base_name:
            raise RolloutError(f"version {version!r} is already loaded; publish updates under a new name")
        started = time.perf_counter()
        if self.adapter_share is not None:
            from trainer.adapters.share import publish

            publish(adapter_dir, self.adapter_share, version)
            self._post("/v1/completions", {"model": version, "prompt": "Hi", "max_tokens": 1, "temperature": 0.0})
        else:
            self._post("/v1/load_lora_adapter", {"lora_name": version, "lora_path": str(Path(adapter_dir).resolve())})
        self.last_load_s = time.perf_counter() - started
        self.versions[version] = candidate

    def unload(self, version: str) -> None:
        """Unload a version (in-flight requests on it finish first on the server)."""
        if version not in self.versions:
            raise RolloutError(f"version {version!r} is not loaded here; loaded: {sorted(self.versions)}")
        self._post("/v1/unload_lora_adapter", {"lora_name": version})
        del self.versions[version]
        if self.adapter_share is not None:
            from trainer.adapters.share import remove

            remove(self.adapter_share, version)

    def served_models(self) -> list[str]:
        """Model names the server lists at ``GET /v1/models`` (base + loaded adapters)."""
        try:
            data = httpx.get(f"{self.url}/v1/models", timeout=self.timeout_s).json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as err:
            raise RolloutError(f"vLLM at {self.url}: GET /v1/models failed: {err}") from err
        return [m["id"] for m in data]

    # -- sampling -------------------------------------------------------------
    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[Sample]]:
        """Send every request at once (batched, see :meth:`batches`); ``n`` samples each, in request order.

        Raises:
            RolloutError: an unknown version, an HTTP error after retries, or an
                answer without token ids / log-probs, with a choice index out of
                range, or with a number of choices other than ``n`` for a prompt.
        """
        self.check(requests)
        return asyncio.run(self._generate_all(requests))

    def check(self, requests: Sequence[RolloutRequest]) -> None:
        """Raises RolloutError for a request with non-int token ids or a version not loaded here."""
        for req in requests:
            if not all(isinstance(t, int) for t in req.prompt_token_ids):
                raise RolloutError(
                    f"request {req.prompt_id!r}: prompt_token_ids must be ints, got {list(req.prompt_token_ids)[:4]}"
                )
            if req.version != self.base_name and req.version not in self.versions:
                raise RolloutError(f"version {req.version!r} is not loaded; loaded: {sorted(self.versions)}")

    def batches(self, requests: Sequence[RolloutRequest]) -> list[list[int]]:
        """Positions of ``requests`` grouped into HTTP requests, first-seen order.

        Requests that differ only in their prompt (same version, ``n``,
        ``max_new_tokens``, ``temperature``, and ``seed`` when it is sent) share
        one ``/v1/completions`` call, at most ``max_prompts_per_request`` prompts each.
        """
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            seed = req.seed if self.per_request_seed and req.temperature > 0 else None
            groups.setdefault((req.version, req.n, req.max_new_tokens, req.temperature, seed), []).append(i)
        size = self.max_prompts_per_request
        return [g[k : k + size] for g in groups.values() for k in range(0, len(g), size)]

    async def _generate_all(self, requests: Sequence[RolloutRequest]) -> list[list[Sample]]:
        batches = self.batches(requests)
        # The semaphore keeps httpx's pool from queueing: a queued request makes the pool
        # rescan every waiting request against every connection on each event, which costs
        # this process a CPU core while vLLM shares the host.
        gate = asyncio.Semaphore(self.max_in_flight)
        limits = httpx.Limits(max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s, limits=limits) as client:

            async def bounded(batch: list[RolloutRequest]) -> list[list[Sample]]:
                async with gate:
                    return await self._batch(client, batch)

            answers = await asyncio.gather(*(bounded([requests[i] for i in b]) for b in batches))
        out: list[list[Sample]] = [[] for _ in requests]
        for positions, groups in zip(batches, answers, strict=True):
            for i, samples in zip(positions, groups, strict=True):
                out[i] = samples
        return out

    @retry(
        retry=retry_if_exception_type(httpx.TransportError),
        stop=stop_after_attempt(3),
        wait=wait_exponential(multiplier=0.5, max=4),
        reraise=True,
    )
    async def _post_completion(self, client: httpx.AsyncClient, body: dict) -> dict:
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise RolloutError(
                f"vLLM /v1/completions for model {body['model']!r} answered {response.status_code}: {response.text[:300]}"
            )
        return response.json()

    async def _batch(self, client: httpx.AsyncClient, batch: Sequence[RolloutRequest]) -> list[list[Sample]]:
        """One ``/v1/completions`` call for requests that differ only in their prompt (see :meth:`batches`).

        vLLM numbers the choices of a batched prompt list ``prompt_index * n + k``
        (``index=len(choices)`` over the prompts' outputs in prompt order, in
        ``entrypoints/openai/completion/serving.py``), so choice ``i`` belongs to
        prompt ``i // n``; when the answer carries ``prompt_token_ids`` they are
        checked against that prompt.
        """
        first = batch[0]
        body = {
            "model": first.version,
            "prompt": [list(req.prompt_token_ids) for req in batch],
            "n": first.n,
            "max_tokens": first.max_new_tokens,
            "temperature": first.temperature,
            "top_p": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": True,
        }
        if self.per_request_seed and first.temperature > 0:
            body["seed"] = first.seed
        try:
            data = await self._post_completion(client, body)
        except httpx.HTTPError as err:
            raise RolloutError(f"vLLM at {self.url}: completion for {first.version!r} failed: {err}") from err
        groups: list[list[Sample]] = [[] for _ in batch]
        choices = data.get("choices")
        if not isinstance(choices, list):
            raise RolloutError(f"vLLM answer for {first.version!r} has no choices list: {str(data)[:300]}")
        for choice in sorted(choices, key=lambda c: c.get("index", -1) if isinstance(c, dict) else -1):
            index = choice.get("index") if isinstance(choice, dict) else None
            if not isinstance(index, int) or not 0 <= index < len(batch) * first.n:
                raise RolloutError(
                    f"vLLM answer for {first.version!r} has a choice with index {index!r}; "
                    f"expected 0..{len(batch) * first.n - 1} for {len(batch)} prompts x n={first.n}"
                )
            req = batch[index // first.n]
            echoed = choice.get("prompt_token_ids")
            if echoed is not None and list(echoed) != list(req.prompt_token_ids):
                raise RolloutError(
                    f"vLLM answer for {first.version!r}: choice {index} echoes another prompt than "
                    f"{req.prompt_id!r}; the server numbers batched choices differently than expected"
                )
            groups[index // first.n].append(self._sample(req, choice))
        for req, samples in zip(batch, groups):
            if len(samples) != req.n:
                raise RolloutError(f"vLLM returned {len(samples)} choices for {req.version!r}, asked for n={req.n}")
        return groups

    @staticmethod
    def _sample(req: RolloutRequest, choice: dict) -> Sample:
        token_ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if token_ids is None or logprobs is None or len(token_ids) != len(logprobs):
            raise RolloutError(
                f"vLLM answer for {req.version!r} lacks matching token_ids/logprobs "
                f"({None if token_ids is None else len(token_ids)} ids, {None if logprobs is None else len(logprobs)} logprobs); "
                "needs a vLLM with return_token_ids support"
            )
        return Sample(
            prompt_id=req.prompt_id,
            text=str(choice.get("text") or ""),
            token_ids=tuple(int(t) for t in token_ids),
            logprobs=tuple(float(x) for x in logprobs),
            adapter_version=req.version,
            finish_reason=choice.get("finish_reason") or "length",
        )
