"""A small Python client for apps that call the Hourglass gateway: send user feedback for a response.

The gateway returns two headers with every traced response (see docs/data-contracts.md): the trace id
(``x-hourglass-trace-id``) and a signed feedback token (``x-hourglass-feedback-token``, bound to the trace
and the API key). With the official ``openai`` SDK, read them from the raw response::

    from openai import OpenAI
    from connectors.client import FeedbackClient, ResponseRef

    llm = OpenAI(base_url="https://gateway.example/v1", api_key=KEY)
    raw = llm.chat.completions.with_raw_response.create(model="hourglass", messages=[...])
    completion = raw.parse()                      # the usual ChatCompletion
    ref = ResponseRef.from_response(raw)          # trace id + feedback token

    with FeedbackClient("https://gateway.example", KEY) as feedback:
        feedback.thumbs(ref, up=True)             # or .rating(ref, 4), .correction(ref, "42")

:class:`HourglassClient` bundles both (an ``openai.OpenAI`` for the gateway and a :class:`FeedbackClient`).

Retries: 429 (waiting at least its ``Retry-After``), 5xx and connection errors are retried with exponential
backoff (tenacity), at most ``max_attempts`` times; a retried post cannot count twice, since the buffer keeps
one vote per user and trace (the latest). Any other 4xx is a :class:`FeedbackRefused` at once.

Errors: :class:`ClientError` (root, a :class:`~connectors.errors.ConnectorError`), :class:`NoFeedbackToken`
(``ValueError``: the response was not traced, e.g. a batch of prompts), :class:`FeedbackRefused`
(``ValueError``: the gateway's 4xx, with its status, code, param and message), :class:`FeedbackUnavailable`
(``ConnectionError``: still failing after the retries).

Upstream API: the gateway's ``POST /v1/feedback`` (:mod:`connectors.gateway.app`); httpx, tenacity.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import httpx
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from connectors.errors import ConnectorError

TRACE_HEADER = "x-hourglass-trace-id"
FEEDBACK_HEADER = "x-hourglass-feedback-token"


class ClientError(ConnectorError):
    """Root of the client's errors."""


class NoFeedbackToken(ClientError, ValueError):
    """The response carries no trace id or feedback token (not traced: a batch of prompts, a token-id
    prompt, or not a response of the Hourglass gateway)."""


class FeedbackRefused(ClientError, ValueError):
    """The gateway refused the feedback (a 4xx other than 429): bad token, wrong key, invalid signal...

    Attributes: ``status`` (HTTP status), ``code`` / ``param`` (the OpenAI error body's, may be None),
    ``message`` (the gateway's explanation).
    """

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(f"feedback refused ({status}{f', {code}' if code else ''}): {message}")
        self.status, self.message, self.code, self.param = status, message, code, param


class FeedbackUnavailable(ClientError, ConnectionError):
    """The feedback could not be stored after the retries (429, 5xx or connection errors every time)."""


@dataclass(frozen=True)
class ResponseRef:
    """What feedback about one response needs: its trace id and feedback token."""

    trace_id: str
    feedback_token: str

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> ResponseRef:
        """From a response's headers (any case-insensitive mapping, e.g. ``httpx.Headers``).

        Raises:
            NoFeedbackToken: a header is missing.
        """
        trace_id, token = headers.get(TRACE_HEADER), headers.get(FEEDBACK_HEADER)
        if not trace_id or not token:
            missing = [name for name, value in ((TRACE_HEADER, trace_id), (FEEDBACK_HEADER, token)) if not value]
            raise NoFeedbackToken(
                f"the response has no {' / '.join(missing)} header: it was not traced (a batch of prompts or "
                "token-id prompt), or it did not come through the Hourglass gateway"
            )
        return cls(trace_id, token)

    @classmethod
    def from_response(cls, response: Any) -> ResponseRef:
        """From anything with ``.headers``: the ``openai`` SDK's raw response
        (``client.chat.completions.with_raw_response.create(...)``), an ``httpx.Response``...

        Raises:
            NoFeedbackToken: the headers are missing.
        """
        return cls.from_headers(response.headers)


class _Retryable(Exception):
    """Internal: a response or error worth another attempt."""

    def __init__(self, detail: str, retry_after_s: float | None = None) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class FeedbackClient:
    """Posts feedback to the gateway's ``/v1/feedback`` (thread-safe like ``httpx.Client``).

    Args:
        base_url: the gateway's address, e.g. ``https://gateway.example`` (with or without ``/v1``).
        api_key: the API key the response was obtained with (the token is bound to it); None when the
            gateway does not require keys.
        timeout_s: per-attempt timeout, seconds.
        max_attempts: attempts in all (1 = no retry).
        max_wait_s: longest wait between attempts, seconds (a longer ``Retry-After`` is cut to it).
        http: an ``httpx.Client`` to use (its base URL and auth are left alone; the client does not close it).
        sleep: how to wait between attempts (tests pass a recorder).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 15.0,
        max_attempts: int = 4,
        max_wait_s: float = 8.0,
        http: httpx.Client | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        root = base_url.rstrip("/")
        self.url = f"{root[: -len('/v1')] if root.endswith('/v1') else root}/v1/feedback"
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._own_http = http is None
        self._http = http or httpx.Client(timeout=timeout_s)
        self._timeout_s = timeout_s
        self._max_attempts = max_attempts
        self._max_wait_s = max_wait_s
        self._sleep = sleep

    # --- the signals ------------------------------------------------------------------------------------

    def thumbs(self, ref: ResponseRef, *, up: bool, **extra: Any) -> dict[str, Any]:
        """Thumbs up (``up=True``) or down. ``extra``: see :meth:`send`."""
        return self.send(ref, thumbs="up" if up else "down", **extra)

    def rating(self, ref: ResponseRef, stars: int, **extra: Any) -> dict[str, Any]:
        """A 1..5 star rating (the gateway refuses anything else with a 422)."""
        return self.send(ref, rating=stars, **extra)

    def correction(self, ref: ResponseRef, text: str, *, up: bool = False, **extra: Any) -> dict[str, Any]:
        """The user's corrected answer; it travels with a vote (thumbs down unless ``up``) and ``edited``."""
        return self.send(ref, thumbs="up" if up else "down", edited=True, correction=text, **extra)

    def send(
        self,
        ref: ResponseRef,
        *,
        thumbs: Literal["up", "down"] | None = None,
        rating: int | None = None,
        edited: bool | None = None,
        regenerated: bool | None = None,
        correction: str | None = None,
        reward: float | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Post one feedback event and wait until the gateway says it is stored.

        Returns:
            The gateway's answer, ``{"trace_id": ..., "status": "stored"}``.

        Raises:
            FeedbackRefused: a 4xx other than 429 (nothing is retried).
            FeedbackUnavailable: 429 / 5xx / connection errors on every attempt.
        """
        body: dict[str, Any] = {"trace_id": ref.trace_id, "feedback_token": ref.feedback_token}
        for key, value in (
            ("thumbs", thumbs),
            ("rating", rating),
            ("edited", edited),
            ("regenerated", regenerated),
            ("correction", correction),
            ("reward", reward),
        ):
            if value is not None:
                body[key] = value
        if metadata:
            body["metadata"] = dict(metadata)
        retrying = Retrying(
            retry=retry_if_exception_type(_Retryable),
            stop=stop_after_attempt(self._max_attempts),
            wait=self._wait,
            reraise=True,
            sleep=self._sleep or time.sleep,
        )
        try:
            return retrying(self._post, body)
        except _Retryable as err:
            raise FeedbackUnavailable(
                f"feedback for trace {ref.trace_id!r} not stored after {self._max_attempts} attempts: {err}"
            ) from None

    def _wait(self, state: RetryCallState) -> float:
        backoff = wait_exponential(multiplier=0.5, max=self._max_wait_s)(state)
        error = state.outcome.exception() if state.outcome is not None else None
        after = error.retry_after_s if isinstance(error, _Retryable) else None
        return min(self._max_wait_s, max(backoff, after or 0.0))

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self._http.post(self.url, json=body, headers=self._headers, timeout=self._timeout_s)
        except httpx.TransportError as err:  # connect, read, write errors and timeouts
            raise _Retryable(f"{type(err).__name__}: {err}") from None
        if response.status_code == 200:
            return dict(response.json())
        message, code, param = _error_of(response)
        if response.status_code == 429 or response.status_code >= 500:
            raise _Retryable(f"HTTP {response.status_code}: {message}", _retry_after_s(response))
        raise FeedbackRefused(response.status_code, message, code, param)

    # --- lifecycle ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the HTTP connections (not those of an ``http`` client passed in)."""
        if self._own_http:
            self._http.close()

    def __enter__(self) -> FeedbackClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class HourglassClient:
    """An app's handle on the gateway: ``openai`` (an ``openai.OpenAI`` pointed at the gateway) and
    ``feedback`` (a :class:`FeedbackClient` with the same key).

    ``chat(**kwargs)`` is ``openai.chat.completions.create`` that also returns the :class:`ResponseRef`;
    ``kwargs`` are the SDK's (``model``, ``messages``, ...).
    """

    def __init__(self, base_url: str, api_key: str, *, max_attempts: int = 4, timeout_s: float = 60.0) -> None:
        import openai  # an app-side dependency: imported only by apps that use this class

        root = base_url.rstrip("/")
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        self.openai = openai.OpenAI(base_url=f"{root}/v1", api_key=api_key, timeout=timeout_s)
        self.feedback = FeedbackClient(root, api_key, max_attempts=max_attempts)

    def chat(self, **kwargs: Any) -> tuple[Any, ResponseRef]:
        """(the ``ChatCompletion``, its :class:`ResponseRef`).

        Raises:
            NoFeedbackToken: the response was not traced.
        """
        raw = self.openai.chat.completions.with_raw_response.create(**kwargs)
        return raw.parse(), ResponseRef.from_response(raw)

    def close(self) -> None:
        self.feedback.close()
        self.openai.close()

    def __enter__(self) -> HourglassClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _error_of(response: httpx.Response) -> tuple[str, str | None, str | None]:
    """(message, code, param) of an OpenAI-style error body; the raw text when it is not one."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        code, param = error.get("code"), error.get("param")
        return str(error.get("message")), str(code) if code is not None else None, str(param) if param else None
    return response.text[:500] or response.reason_phrase, None, None


def _retry_after_s(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the exponential backoff applies
