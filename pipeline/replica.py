"""One vLLM OpenAI server seen from the control plane: list, load, unload, probe.

Upstream API (vLLM OpenAI server, runtime LoRA updating enabled with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``):

- ``GET /v1/models``: the base and every loaded LoRA adapter, by name;
- ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``;
- ``POST /v1/unload_lora_adapter {"lora_name"}``;
- ``POST /v1/completions`` with ``model=<adapter name>``: the probe.

Two error kinds: :class:`ReplicaUnreachableError` (connection refused, timeout:
the replica may come back, retry later) and :class:`ReplicaRefusedError` (the
server answered with an error status: the adapter, not the network, is the
problem).
"""

from __future__ import annotations

import httpx

from pipeline.errors import PipelineError

PROBE_PROMPT = "Hello"
PROBE_TOKENS = 2


class ReplicaUnreachableError(PipelineError, ConnectionError):
    """A vLLM replica did not answer (down, restarting, or timed out)."""


class ReplicaRefusedError(PipelineError, RuntimeError):
    """A vLLM replica answered a load, unload or probe with an error status."""


class Replica:
    """HTTP control of one vLLM server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, what: str, **kwargs) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise ReplicaUnreachableError(f"vLLM at {self.url} did not answer {what}: {type(err).__name__}: {err}") from err
        if response.status_code >= 400:
            raise ReplicaRefusedError(
                f"vLLM at {self.url} refused {what}: HTTP {response.status_code}: {response.text[:500]}"
            )
        return response

    def models(self) -> list[str]:
        """Names served now (the base and loaded adapters), from ``GET /v1/models``.

        Raises:
            ReplicaUnreachableError: the server did not answer.
            ReplicaRefusedError: it answered with an error status.
        """
        data = self._call("GET", "/v1/models", "GET /v1/models", timeout=5.0).json()
        return [str(m["id"]) for m in data.get("data", [])]

    def load(self, name: str, path: str) -> None:
        """Load the adapter folder ``path`` under ``name`` (an already loaded name is not an error).

        Raises:
            ReplicaUnreachableError, ReplicaRefusedError.
        """
        try:
            self._call("POST", "/v1/load_lora_adapter", f"load {name!r} from {path}", json={"lora_name": name, "lora_path": path})
        except ReplicaRefusedError as err:
            if "already been loaded" in str(err) or "already loaded" in str(err):
                return
            raise

    def unload(self, name: str) -> None:
        """Unload ``name``; unloading a name that is not loaded is not an error.

        Raises:
            ReplicaUnreachableError, ReplicaRefusedError.
        """
        try:
            self._call("POST", "/v1/unload_lora_adapter", f"unload {name!r}", json={"lora_name": name})
        except ReplicaRefusedError as err:
            if "cannot be found" in str(err) or "not found" in str(err).lower() or "HTTP 404" in str(err):
                return
            raise

    def probe(self, name: str) -> str:
        """One short greedy completion through ``name``; returns its text.

        Raises:
            ReplicaUnreachableError, ReplicaRefusedError: including an answer
                without choices.
        """
        body = {"model": name, "prompt": PROBE_PROMPT, "max_tokens": PROBE_TOKENS, "temperature": 0.0}
        data = self._call("POST", "/v1/completions", f"a probe completion through {name!r}", json=body).json()
        choices = data.get("choices") or []
        if not choices or data.get("model") not in (None, name):
            raise ReplicaRefusedError(f"vLLM at {self.url} answered the probe through {name!r} without a completion: {data}")
        return str(choices[0].get("text", ""))
