"""One vLLM OpenAI server seen from the control plane: list, load, unload, probe.

Upstream API (vLLM OpenAI server, runtime LoRA updating enabled with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``):

- ``GET /v1/models``: the base and every loaded LoRA adapter, by name;
- ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``;
- ``POST /v1/unload_lora_adapter {"lora_name"}``;
- ``POST /v1/completions`` with ``model=<adapter name>``: the probe.

When vLLM runs with ``--api-key`` (or ``VLLM_API_KEY``), every call carries
``Authorization: Bearer <serving.api_key>``.

Two error kinds, by whose fault it is:

- :class:`ReplicaUnreachableError`: the replica's fault, transient (connection
  refused, timeout, or a 5xx answer: overloaded, restarting, a proxy in front
  of it); retry later. :class:`ReplicaServerError` is its 5xx subclass.
- :class:`ReplicaRefusedError`: the adapter's fault (a 4xx answer to a load or
  probe, a probe without a valid completion, or a load that a healthy replica
  answers with HTTP 500 twice in a row: vLLM reports an adapter it cannot
  read that way).
"""

from __future__ import annotations

import math
import time
from typing import Protocol

import httpx

from pipeline.errors import PipelineError

PROBE_PROMPT = "Hello"
PROBE_TOKENS = 16  # greedy tokens: enough for a broken adapter (NaN weights, garbage scales) to show


class ReplicaUnreachableError(PipelineError, ConnectionError):
    """A vLLM replica did not answer (down, restarting, or timed out)."""


class ReplicaServerError(ReplicaUnreachableError):
    """A vLLM replica answered with a 5xx status (a replica problem; retry later)."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class ReplicaRefusedError(PipelineError, RuntimeError):
    """A vLLM replica refused a load, unload or probe for a reason that is the adapter's (4xx, invalid answer)."""


class ReplicaControl(Protocol):
    """What the serving controller needs from a replica (:class:`Replica` over HTTP; fakes in unit tests).

    Each method raises :class:`ReplicaUnreachableError` for a replica problem
    (transient) and :class:`ReplicaRefusedError` for the adapter's fault.
    """

    url: str

    def models(self) -> list[str]: ...

    def load(self, name: str, path: str) -> None: ...

    def unload(self, name: str) -> None: ...

    def probe(self, name: str) -> str: ...

    def close(self) -> None: ...


class Replica:
    """HTTP control of one vLLM server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, timeout_s: float = 60.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, what: str, **kwargs) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise ReplicaUnreachableError(
                f"vLLM at {self.url} did not answer {what}: {type(err).__name__}: {err}"
            ) from err
        if response.status_code >= 500:
            raise ReplicaServerError(
                f"vLLM at {self.url} failed {what}: HTTP {response.status_code}: {response.text[:500]}",
                response.status_code,
            )
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

    def healthy(self) -> bool:
        """True when ``GET /health`` answers 200 within 5 s."""
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def load(self, name: str, path: str, *, retry_pause_s: float = 1.0) -> None:
        """Load the adapter folder ``path`` under ``name`` (an already loaded name is not an error).

        An HTTP 500 is retried once after ``retry_pause_s``; if the replica
        answers ``/health`` with 200 both times, the adapter is what it cannot
        load (vLLM answers an unreadable adapter with HTTP 500) and the load is
        refused. Any other 5xx, or a 500 from an unhealthy replica, is the
        replica's problem.

        Raises:
            ReplicaUnreachableError: no answer, or a 5xx while the replica is unhealthy (transient).
            ReplicaRefusedError: a 4xx, or a 500 twice from a healthy replica (the adapter's fault).
        """
        what = f"load {name!r} from {path}"
        body = {"lora_name": name, "lora_path": path}
        try:
            try:
                self._call("POST", "/v1/load_lora_adapter", what, json=body)
            except ReplicaServerError as err:
                if err.status_code != 500 or not self.healthy():  # 502/503/504: a proxy or an overloaded server
                    raise
                time.sleep(retry_pause_s)
                try:
                    self._call("POST", "/v1/load_lora_adapter", what, json=body)
                except ReplicaServerError as again:
                    if not self.healthy():
                        raise
                    raise ReplicaRefusedError(
                        f"vLLM at {self.url} refused {what} twice while healthy: HTTP {again.status_code}: {again}"
                    ) from again
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
        """A greedy completion of ``PROBE_TOKENS`` tokens through ``name``, with logprobs; returns its text.

        A broken adapter (NaN or huge weights) shows as an empty completion or
        non-finite logprobs; both are refused.

        Raises:
            ReplicaUnreachableError: no answer or a 5xx (transient).
            ReplicaRefusedError: a 4xx, or an answer without a completion, an
                empty completion, or a NaN/inf logprob.
        """
        body = {"model": name, "prompt": PROBE_PROMPT, "max_tokens": PROBE_TOKENS, "temperature": 0.0, "logprobs": 1}
        response = self._call("POST", "/v1/completions", f"a probe completion through {name!r}", json=body)
        try:
            data = response.json()
        except ValueError:
            raise ReplicaRefusedError(
                f"vLLM at {self.url} answered the probe through {name!r} with non-JSON: {response.text[:200]!r}"
            ) from None
        if not isinstance(data, dict):
            raise ReplicaRefusedError(
                f"vLLM at {self.url} answered the probe through {name!r} without a completion: {data!r:.300}"
            )
        choices = data.get("choices") or []
        if not choices or data.get("model") not in (None, name):
            raise ReplicaRefusedError(
                f"vLLM at {self.url} answered the probe through {name!r} without a completion: {str(data)[:500]}"
            )
        text = str(choices[0].get("text") or "")
        logprobs = (choices[0].get("logprobs") or {}).get("token_logprobs") or []
        if not text or not logprobs:
            raise ReplicaRefusedError(
                f"vLLM at {self.url}: the probe through {name!r} generated nothing; the adapter is broken"
            )
        bad = [lp for lp in logprobs if not isinstance(lp, (int, float)) or not math.isfinite(lp)]
        if bad:
            raise ReplicaRefusedError(
                f"vLLM at {self.url}: the probe through {name!r} has non-finite logprobs {bad[:4]}; the adapter's weights are broken"
            )
        return text
