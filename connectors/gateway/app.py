"""OpenAI-compatible gateway in front of vLLM that emits one trace event per request.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (plain and
``stream: true`` SSE) are proxied to vLLM with the public model name rewritten
to the served one (``resolve_model``); ``GET /v1/models`` lists the public
names; ``POST /v1/feedback`` publishes a feedback event; ``GET /healthz`` and
``GET /metrics`` (Prometheus) serve operations.

Security (see docs/security.md): every ``/v1`` call needs
``Authorization: Bearer <API key>`` (401 without, 403 unknown or revoked)
unless ``gateway.require_api_key`` is false; bodies must be
``application/json`` (415) under ``gateway.max_body_bytes`` (413), with only
the fields of :data:`connectors.gateway.request.ALLOWED` and within the caps
(400); each key has a request rate and a concurrency limit (429 with
``Retry-After``). The client's ``Authorization`` and raw ``user`` never go
upstream; the gateway sends its own vLLM key. A client that hangs up aborts
its upstream request, streamed or not.

Every proxied response carries ``x-hourglass-trace-id`` (uuid4 hex) and, when it will be
traced, ``x-hourglass-feedback-token`` (see :class:`~connectors.gateway.auth.FeedbackSigner`);
``/v1/feedback`` requires that token and the same API key. Only the first
choice (index 0) is traced; batches and token-id prompts are served, not traced.
Function tools pass through (``tools``, ``tool_choice``, assistant ``tool_calls``,
``tool`` messages: :mod:`connectors.gateway.tools`); the answer's ``tool_calls`` and
``finish_reason`` reach the client as vLLM sent them. Each chat trace carries its
``conversation_id``, ``turn`` and ``parent_trace_id``
(:mod:`connectors.gateway.conversation`) and the prompt token ids vLLM rendered.
The trace event is published after the response body is produced, through
:class:`~connectors.gateway.events.EventPublisher`, so Kafka never slows or
fails the client. A stream that does not complete is not traced, and feedback with
its token is a 409 (:class:`~connectors.gateway.streams.StreamLedger`). More than
one ``Host`` or ``Authorization`` header is a 400. Errors (an unknown path's 404 and a wrong method's 405
too) use the OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` and never name internal
addresses.

Upstream API: OpenAI Chat Completions / Completions (as served by vLLM 0.32).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from connectors.gateway.auth import (
    ANONYMOUS,
    AuthError,
    ConcurrencyLimiter,
    FeedbackSigner,
    KeyStore,
    KeyStoreError,
    RateLimiter,
)
from connectors.config import BufferConfig, GatewayConfig, KafkaConfig, RewardSpec
from connectors.edge import EdgeLimits, server_config
from connectors.errors import ConnectorConfigError
from connectors.gateway.conversation import ConversationLinker, PromptHash, TurnLink
from connectors.gateway.events import TRACE_ERRORS, EventPublisher
from connectors.gateway.streams import INCOMPLETE_FINISH, StreamLedger
from connectors.gateway.request import (
    ClosingStream,
    RequestRefused,
    SingleHeaders,
    bound_generation,
    check_content_type,
    check_finite,
    check_request,
    client_metadata,
    describe_errors,
    error_param,
    forwarded_messages,
    openai_error,
    parse_json,
    read_body,
    refused,
)
from connectors.gateway.trace import (
    ClientAsked,
    Completion,
    Endpoint,
    build_trace,
    strip_extras,
    trace_prompt,
    upstream_body,
)
from connectors.reward import reward_from_signals
from connectors.schema import FeedbackEvent, UserHasher, correction_refused
from connectors.sink import TraceSink

log = logging.getLogger(__name__)

TRACE_HEADER = "x-hourglass-trace-id"
FEEDBACK_HEADER = "x-hourglass-feedback-token"
REQUESTS = Counter(
    "hourglass_gateway_requests", "Gateway requests by endpoint and HTTP status.", ["endpoint", "status"]
)
FEEDBACK_BY_KEY = Counter(
    "hourglass_gateway_feedback", "Feedback events accepted, by API key id (topk(rate(...)) finds floods).", ["key_id"]
)
FEEDBACK_REWARD = Histogram(
    "hourglass_feedback_reward",
    "Reward each accepted feedback event stands for (buffer.reward mapping).",
    buckets=(-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0),
)
CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never seen by the client
# What a trace is published with: trace id, endpoint, request body (metadata hashed), public model name,
# served name, adapter version, user hash, key hash, the max_tokens bound vLLM was given, and for chat the
# request's place in its conversation and its prompt hash.
_PublishArgs = tuple[
    str, Endpoint, dict[str, Any], str, str, str | None, str, str, int, TurnLink | None, PromptHash | None
]

ResolveModel = Callable[[str], tuple[str, str | None]]


class FeedbackIn(BaseModel):
    """Body of ``POST /v1/feedback``: the trace it is about, its feedback token and at least one signal."""

    model_config = ConfigDict(extra="forbid")

    trace_id: str = Field(min_length=1, max_length=256, description="The x-hourglass-trace-id of the response.")
    feedback_token: str | None = Field(
        default=None,
        max_length=2048,
        description="The x-hourglass-feedback-token of the response (or send it in that header).",
    )
    # Every signal is strict (JSON types only): "yes" for a flag or "1" for a rating is a 422, never a coerced vote.
    thumbs: Any = Field(default=None, description='"up" or "down".')
    rating: int | None = Field(
        default=None,
        ge=1,
        le=5,
        strict=True,
        description='Star rating 1..5 (an integer: true, "3" or 3.0 are refused).',
    )
    reward: float | None = Field(
        default=None,
        strict=True,
        allow_inf_nan=False,
        description='Explicit reward (trusted-grader keys only; clipped to [-1, 1]; a JSON number, "0.5" is refused).',
    )
    edited: bool | None = Field(default=None, strict=True, description="The user edited the answer (true/false only).")
    regenerated: bool | None = Field(
        default=None, strict=True, description="The user asked for another answer (true/false only)."
    )
    correction: str | None = Field(
        default=None,
        description="The user's corrected answer: at most buffer.max_correction_chars characters, none that a reader "
        "cannot see (connectors.schema.hidden_characters).",
    )
    metadata: dict[str, Any] = Field(default_factory=dict, description="Free-form; user ids are hashed.")

    @field_validator("thumbs")
    @classmethod
    def _thumbs(cls, value: Any) -> Any:
        if value is not None and value not in ("up", "down"):
            raise ValueError(f'thumbs must be "up" or "down", got {repr(value)[:100]}')  # not a 1 MiB echo
        return value

    @model_validator(mode="after")
    def _checks(self) -> FeedbackIn:
        if all(getattr(self, k) is None for k in ("thumbs", "rating", "reward", "edited", "regenerated")):
            raise ValueError("give at least one signal: thumbs, rating, reward, edited or regenerated")
        return self


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the API key's id, whether it is a trusted grader, and its limits."""

    key_id: str
    trusted_grader: bool
    rate_per_min: int
    concurrency: int
    tokens_per_min: int


def create_gateway_app(
    kafka: KafkaConfig,
    upstream_url: str,
    resolve_model: ResolveModel,
    *,
    sink: TraceSink | None = None,
    list_models: Callable[[], Iterable[str]] | None = None,
    user_hasher: UserHasher | None = None,
    gateway: GatewayConfig | None = None,
    keys: KeyStore | None = None,
    signer: FeedbackSigner | None = None,
    trusted_metadata: Iterable[str] | None = None,
    reward_spec: RewardSpec | None = None,
    max_correction_chars: int | None = None,
    upstream_api_key: str | None = None,
    timeout_s: float | None = None,
    feedback_timeout_s: float = 15.0,
    upstream_transport: httpx.AsyncBaseTransport | None = None,
    max_model_len: int | None = None,
) -> FastAPI:
    """Build the gateway app.

    Args:
        kafka: where trace/feedback events go (the topics must exist; see ``kafka_admin.ensure_topics``).
        upstream_url: vLLM base URL, e.g. ``http://127.0.0.1:18000`` (no ``/v1``).
        resolve_model: public model name -> ``(vLLM served name, adapter version or None for the base)``;
            raises ``LookupError`` (``KeyError``) for an unknown name (the client gets 404). When it also has a
            ``route(public, routing_key) -> (served, version, canary)`` method (a canary split), that is called
            with a keyed hash of the hashed ``user`` (else of the trace id) as the routing key, and a non-None ``canary`` is written
            to the trace's ``metadata.canary``.
        sink: publish through this sink (caller closes it); None = the gateway creates and closes its own,
            retrying while the broker is unreachable.
        list_models: the public names for ``GET /v1/models`` (default: none).
        user_hasher: hashes caller identities and user ids in ``metadata`` (default: keyed with
            ``BufferConfig()`` defaults; pass the configured one).
        gateway: limits and authentication (default ``GatewayConfig()``).
        keys: the API key store; required when ``gateway.require_api_key``.
        signer: feedback token signer (default: a random key for this process, ``gateway.feedback_token_ttl_s``).
        trusted_metadata: metadata keys a trusted grader may set as labels (default ``buffer.trusted_metadata``).
        reward_spec: feedback -> reward mapping of the ``hourglass_feedback_reward`` histogram.
        max_correction_chars: longest feedback ``correction`` (characters; default ``buffer.max_correction_chars``);
            a longer one is a 400 here instead of an event that ingest would dead-letter as ``oversize_correction``
            (as is one holding characters a reader cannot see, ``hidden_characters``).
        upstream_api_key: the gateway's own vLLM key (``serving.api_key``), sent as ``Authorization``.
        timeout_s: upstream read timeout, seconds (default ``gateway.upstream_timeout_s``).
        feedback_timeout_s: how long feedback waits for the broker ack, seconds.
        upstream_transport: the httpx transport to the model server (default: HTTP to ``upstream_url``;
            tests pass an ``httpx.MockTransport`` or an ``httpx.ASGITransport`` of a fake server).
        max_model_len: the model server's context length in tokens (``serving.max_model_len``); a request that
            sends no ``max_tokens`` / ``max_completion_tokens`` (or null) gets ``max_tokens`` =
            ``min(gateway.max_tokens, max_model_len)`` (vLLM refuses a bound above its context).

    Raises:
        ConnectorConfigError: ``gateway.require_api_key`` without a key store.

    The resources (httpx client, publisher thread) live in the app's lifespan: serve the app with an
    ASGI server that runs lifespan events (uvicorn does).
    """
    cfg = gateway or GatewayConfig()
    if cfg.require_api_key and keys is None:
        raise ConnectorConfigError(
            "gateway.require_api_key is true but no API key store was given (keys=KeyStore(path))"
        )
    hasher = user_hasher or UserHasher(BufferConfig().user_hash_key.get_secret_value(), BufferConfig().user_id_keys)
    signer = signer or FeedbackSigner(secrets.token_bytes(32), cfg.feedback_token_ttl_s)
    trusted_keys = list(BufferConfig().trusted_metadata if trusted_metadata is None else trusted_metadata)
    spec = reward_spec or RewardSpec()
    correction_cap = BufferConfig().max_correction_chars if max_correction_chars is None else max_correction_chars
    base = upstream_url.rstrip("/")
    default_max_tokens = cfg.max_tokens if max_model_len is None else min(cfg.max_tokens, max_model_len)
    rates, generation, in_flight = RateLimiter(), RateLimiter(), ConcurrencyLimiter()
    linker = ConversationLinker(
        hasher.derive("conversation"), entries=cfg.conversation_cache_entries, ttl_s=cfg.conversation_ttl_s
    )
    streams = StreamLedger(signer.ttl_s)  # streamed answers that are not (or never will be) complete traces
    upstream_headers = {"content-type": "application/json"}
    if upstream_api_key:
        upstream_headers["authorization"] = f"Bearer {upstream_api_key}"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.client = httpx.AsyncClient(
            base_url=base,
            timeout=httpx.Timeout(timeout_s or cfg.upstream_timeout_s, connect=10.0),
            transport=upstream_transport,
        )
        app.state.publisher = EventPublisher(kafka, sink)
        try:
            yield
        finally:
            # Shutdown order: 1. uvicorn has stopped taking requests, 2. close upstream connections,
            # 3. publish what is queued and close an owned sink (off the event loop).
            await app.state.client.aclose()
            await asyncio.to_thread(app.state.publisher.close)

    # no /docs, /redoc or /openapi.json on the client-facing port: the API is OpenAI's, documented in docs/
    app = FastAPI(title="Hourglass gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(SingleHeaders)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = [{**e, "loc": e["loc"][1:]} for e in err.errors()]  # loc[0] is "body" / "query"
        REQUESTS.labels(request.url.path, "422").inc()
        return openai_error(
            422, f"invalid request: {describe_errors(errors)}", type_="invalid_request_error", param=error_param(errors)
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        """Starlette's own refusals (no such path: 404, a method the path does not take: 405 with its
        ``Allow``) in the OpenAI error body rather than FastAPI's ``{"detail": ...}``. The client's path and
        method are cut (they may be long); no metric is labelled with them (made-up paths are unbounded)."""
        path = request.url.path if len(request.url.path) <= 80 else f"{request.url.path[:80]}..."
        method = request.method[:20]
        if err.status_code == 404:
            message, code = f"Invalid URL ({method} {path})", "unknown_url"
        elif err.status_code == 405:
            allow = (err.headers or {}).get("Allow")
            message = f"method {method} is not allowed on {path}" + (f"; allowed: {allow}" if allow else "")
            code = "method_not_allowed"
        else:
            message, code = str(err.detail)[:200], None
        type_ = "invalid_request_error" if err.status_code < 500 else "server_error"
        return openai_error(err.status_code, message, type_=type_, code=code, headers=dict(err.headers or {}))

    def identity(key_id: str, user: str | None) -> str:
        """The end user's hash: the key id, plus the request's ``user`` scoped to that key."""
        return hasher.digest(key_id if user is None else f"{key_id}\x00{user}")

    def key_hash(key_id: str) -> str:
        """The API key's hash (``metadata.key_hash``): the key's public id under the same keyed hasher as user
        ids, in its own namespace. Rounds and canaries cap each key's share (``rl.split.max_key_share``): a key
        may send any ``user`` values, so its users are not the unit a client's influence is bounded by."""
        return hasher.digest(f"key\x00{key_id}")

    def authenticate(request: Request) -> Caller:
        header = request.headers.get("authorization")
        if header is None or not header.lower().startswith("bearer ") or not header[7:].strip():
            if not cfg.require_api_key:
                return Caller(ANONYMOUS, False, cfg.rate_per_min, cfg.concurrency, cfg.tokens_per_min)
            raise RequestRefused(
                401,
                "an API key is required: send 'Authorization: Bearer <key>' (see `hourglass keys create`)",
                type_="authentication_error",
                code="missing_api_key",
                headers={"www-authenticate": "Bearer"},
            )
        if not cfg.require_api_key and keys is None:
            return Caller(ANONYMOUS, False, cfg.rate_per_min, cfg.concurrency, cfg.tokens_per_min)
        try:
            record = keys.authenticate(header[7:].strip())  # type: ignore[union-attr]
        except AuthError as err:
            raise RequestRefused(403, str(err), type_="permission_error", code="invalid_api_key") from None
        except KeyStoreError as err:  # a damaged key file: refuse everyone, loudly, rather than fail open
            log.error("gateway: %s", err)
            raise RequestRefused(
                503, "API keys cannot be checked right now; retry later", type_="service_unavailable"
            ) from None
        return Caller(
            record.key_id,
            record.trusted_grader,
            record.rate_per_min or cfg.rate_per_min,
            record.concurrency or cfg.concurrency,
            record.tokens_per_min or cfg.tokens_per_min,
        )

    def rate_limited(message: str, code: str, wait_s: float) -> RequestRefused:
        """A 429 whose message and ``Retry-After`` say when the key's bucket holds enough again."""
        retry = math.ceil(wait_s)
        return RequestRefused(
            429,
            f"{message}; retry in {retry} s",
            type_="rate_limit_error",
            code=code,
            headers={"retry-after": str(retry)},
        )

    async def admit(request: Request) -> tuple[Caller, Any]:
        """Authenticate, rate-limit, read and parse the body; the caller holds one concurrency slot after this."""
        caller = authenticate(request)
        check_content_type(request)
        # The concurrency slot first: a request refused for concurrency must not spend a rate token (else a
        # burst of refused requests drains the bucket and the key is served far below its rate).
        if not in_flight.try_enter(caller.key_id, caller.concurrency):
            raise RequestRefused(
                429,
                f"{caller.concurrency} requests of this API key are already in flight; retry when one finishes",
                type_="rate_limit_error",
                code="too_many_concurrent_requests",
                headers={"retry-after": "1"},
            )
        wait_s = rates.acquire(caller.key_id, caller.rate_per_min)
        if wait_s > 0:
            in_flight.leave(caller.key_id)
            raise rate_limited(
                f"rate limit of {caller.rate_per_min} requests per minute for this API key reached",
                "rate_limited",
                wait_s,
            )
        try:
            body = parse_json(await read_body(request, cfg.max_body_bytes, cfg.body_timeout_s), cfg.max_json_depth)
        except BaseException:
            in_flight.leave(caller.key_id)
            raise
        return caller, body

    def charge_generation(
        caller: Caller, body: dict[str, Any], endpoint: Endpoint, max_tokens: int, *, defaulted: bool
    ) -> int:
        """Take the tokens this request may generate (``n`` x ``max_tokens`` x its prompts) from the key's
        ``tokens_per_min`` bucket and return them, or refuse it: 400 when it alone costs more than the bucket
        holds, else 429. ``defaulted``: ``max_tokens`` is the gateway's default (the request set none).
        Charged once the request is valid and its model known; a request that then fails (an upstream error, the
        upstream unreachable) gets them back in :func:`_proxy`, one whose client hung up does not."""
        n = body.get("n") or 1
        prompt = body.get("prompt") if endpoint == "completions" else None
        # a completions batch is a list of prompts; one prompt may be a list of token ids
        prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        cost = int(n) * max_tokens * max(1, prompts)
        limit = caller.tokens_per_min
        if cost > limit:
            default = " (the gateway's default: the request sets none)" if defaulted else ""
            raise RequestRefused(
                400,
                f"this request may generate {cost} tokens (n={n} x max_tokens={max_tokens}{default}"
                f"{f' x {prompts} prompts' if prompts > 1 else ''}), above this API key's {limit} tokens per minute; "
                "set a lower max_tokens or n",
                param="max_tokens",
                code="request_exceeds_token_rate",
            )
        wait_s = generation.acquire(caller.key_id, limit, cost=cost)
        if wait_s > 0:
            raise rate_limited(
                f"token rate limit of {limit} generation tokens per minute for this API key reached (this request may "
                f"generate {cost})",
                "tokens_rate_limited",
                wait_s,
            )
        return cost

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if cfg.metrics_token is not None:
            header = request.headers.get("authorization") or ""
            given = header[7:].strip() if header.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(given.encode(), cfg.metrics_token.get_secret_value().encode()):
                return openai_error(
                    401,
                    "GET /metrics needs the metrics token: send 'Authorization: Bearer <gateway.metrics_token>'",
                    type_="authentication_error",
                    code="missing_metrics_token",
                )
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            authenticate(request)
        except RequestRefused as err:
            REQUESTS.labels("/v1/models", str(err.status)).inc()
            return refused(err)
        names = list(list_models()) if list_models is not None else []
        REQUESTS.labels("/v1/models", "200").inc()
        return JSONResponse(
            {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "hourglass"} for n in names]}
        )

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> Response:
        try:
            caller, data = await admit(request)
        except RequestRefused as err:
            REQUESTS.labels("/v1/feedback", str(err.status)).inc()
            return refused(err)
        try:
            response = await _feedback(request, caller, data)
        except RequestRefused as err:
            response = refused(err)
        finally:
            in_flight.leave(caller.key_id)
        REQUESTS.labels("/v1/feedback", str(response.status_code)).inc()
        return response

    async def _feedback(request: Request, caller: Caller, data: Any) -> Response:
        try:
            body = FeedbackIn.model_validate(data)
        except ValidationError as err:
            errors = err.errors()
            raise RequestRefused(
                422, f"invalid request: {describe_errors(errors)}", param=error_param(errors)
            ) from None
        if body.correction is not None and len(body.correction) > correction_cap:
            raise RequestRefused(
                400,
                f"correction is {len(body.correction)} characters, above buffer.max_correction_chars={correction_cap}; "
                "send a shorter correction",
                param="correction",
            )
        hidden = correction_refused(body.correction, None)  # what ingest would dead-letter as hidden_characters
        if hidden is not None:
            raise RequestRefused(400, hidden.detail, param="correction")
        check_finite(body.metadata, "body.metadata")  # as in chat requests: NaN is a 400, never a stored null
        meta_size = len(json.dumps(body.metadata, separators=(",", ":")))
        if meta_size > cfg.max_metadata_bytes:
            raise RequestRefused(
                400,
                f"field 'metadata' is {meta_size} bytes, above gateway.max_metadata_bytes={cfg.max_metadata_bytes}",
                param="metadata",
            )
        header_token = request.headers.get(FEEDBACK_HEADER)
        if body.feedback_token is not None and header_token is not None and body.feedback_token != header_token:
            raise RequestRefused(  # read one way only: two tokens that differ are two requests in one
                400,
                f"the feedback token is given twice and differently: in '{FEEDBACK_HEADER}' and as 'feedback_token'; "
                "send one",
                param="feedback_token",
            )
        token = body.feedback_token or header_token
        if not token:
            raise RequestRefused(
                400,
                f"feedback needs the response's feedback token: send the {FEEDBACK_HEADER} header "
                "of the response, or its value as 'feedback_token'",
                param="feedback_token",
            )
        try:
            claims = signer.verify(token, body.trace_id, caller.key_id)
        except AuthError as err:
            raise RequestRefused(
                403, str(err), type_="permission_error", param="feedback_token", code="invalid_feedback_token"
            ) from None
        stream_state = streams.state(body.trace_id)
        if stream_state == "streaming":
            raise RequestRefused(
                409,
                f"trace {body.trace_id!r} is a streamed answer still streaming; send feedback after its last chunk",
                param="trace_id",
                code="trace_in_progress",
            )
        if stream_state == "failed":
            raise RequestRefused(
                409,
                f"trace {body.trace_id!r} is a streamed answer that did not complete (the model server failed or "
                "the stream was cut midway); it was not recorded and takes no feedback",
                param="trace_id",
                code="trace_incomplete",
            )
        if body.reward is not None and not caller.trusted_grader:
            raise RequestRefused(
                403,
                "an explicit 'reward' is accepted only from trusted-grader API keys; send thumbs or rating instead",
                type_="permission_error",
                param="reward",
            )
        out = body.model_dump(exclude_none=True, exclude={"feedback_token"})
        if body.reward is not None:
            out["reward"] = max(-1.0, min(1.0, body.reward))
        meta = hasher({k: v for k, v in body.metadata.items() if k != "user_hash"})
        meta = {k: v for k, v in meta.items() if k != "key_hash"}
        # the voter: one vote per (trace, user_hash); and the key it came through (the caller's: the token's key)
        out["metadata"] = {**meta, "user_hash": claims.user_hash, "key_hash": key_hash(caller.key_id)}
        out["ts"] = datetime.now(UTC)  # when the feedback was given
        event = FeedbackEvent.model_validate(out)
        loop = asyncio.get_running_loop()
        acked: asyncio.Future[Exception | None] = loop.create_future()

        def on_done(err: Exception | None) -> None:
            def settle() -> None:
                if not acked.done():
                    acked.set_result(err)

            loop.call_soon_threadsafe(settle)

        app.state.publisher.publish_feedback(event, on_done)
        failure: Exception | None
        try:
            failure = await asyncio.wait_for(acked, feedback_timeout_s)
        except TimeoutError:
            failure = TimeoutError(f"no broker acknowledgement within {feedback_timeout_s}s")
        if failure is not None:
            log.error("gateway: feedback for trace %s not stored: %s", body.trace_id, failure)
            return openai_error(
                503,
                f"feedback for trace {body.trace_id!r} was not stored (the event store is unavailable); retry later",
                type_="service_unavailable",
            )
        FEEDBACK_BY_KEY.labels(caller.key_id).inc()
        reward, _ = reward_from_signals(event.signals(), spec)
        if reward is not None:
            FEEDBACK_REWARD.observe(reward)
        return JSONResponse({"trace_id": body.trace_id, "status": "stored"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _proxy(request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _proxy(request, "completions", "/v1/completions")

    async def _proxy(request: Request, endpoint: Endpoint, path: str) -> Response:
        started = time.perf_counter()
        try:
            caller, body = await admit(request)
        except RequestRefused as err:
            REQUESTS.labels(path, str(err.status)).inc()
            return refused(err)
        released = False
        charged: list[int] = []  # the generation tokens taken from the key's bucket (charge_generation)

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                in_flight.leave(caller.key_id)

        response: Response | None = None
        try:
            response = await _proxy_inner(request, caller, body, endpoint, path, started, release, charged)
        except RequestRefused as err:
            response = refused(err)
        finally:
            if not isinstance(response, ClosingStream):
                await release()  # a stream releases when it ends
            if charged and (response is None or (response.status_code >= 400 and response.status_code != CLIENT_GONE)):
                generation.refund(caller.key_id, caller.tokens_per_min, charged[0])  # nothing was generated
        REQUESTS.labels(path, str(response.status_code)).inc()
        return response

    async def _proxy_inner(
        request: Request,
        caller: Caller,
        body: Any,
        endpoint: Endpoint,
        path: str,
        started: float,
        release: Callable[[], Any],
        charged: list[int],
    ) -> Response:
        if not isinstance(body, dict):
            raise RequestRefused(400, f"request body must be a JSON object, got {type(body).__name__}")
        public = body.get("model")
        if not isinstance(public, str) or not public:
            raise RequestRefused(
                400, "field 'model' is required (a public model name, see GET /v1/models)", param="model"
            )
        check_request(endpoint, body, cfg)
        if endpoint == "chat":
            body = forwarded_messages(body)  # the null keys an SDK echoes back dropped, upstream and in the trace
        client_bound = body.get("max_completion_tokens") or body.get("max_tokens")
        body, max_tokens = bound_generation(body, default_max_tokens)
        trace_id = uuid.uuid4().hex
        user = body.get("user")
        user_hash = identity(caller.key_id, user)
        link: TurnLink | None = None
        prompt_hash: PromptHash | None = None
        if endpoint == "chat":
            hint = (body.get("metadata") or {}).get("conversation_id")
            link, prompt_hash = linker.link(user_hash, body["messages"], hint)
        route = getattr(resolve_model, "route", None)  # a canary-aware resolver also takes the routing key
        # Sticky per end user, and keyed: the client sees its user hash (in the feedback token) and the trace id,
        # and canary_bucket is a public function, so routing on either would tell it which side answered.
        routing_key = hasher.digest(f"canary\x00{user_hash if user is not None else trace_id}")
        try:
            served, version, canary = (
                route(public, routing_key) if route is not None else (*resolve_model(public), None)
            )
        except LookupError:
            raise RequestRefused(
                404,
                f"The model `{public[:80]}{'...' if len(public) > 80 else ''}` does not exist; ask GET /v1/models "
                "for the served names",
                param="model",
                code="model_not_found",
            ) from None
        charged.append(charge_generation(caller, body, endpoint, max_tokens, defaulted=client_bound is None))
        traced = {
            **body,
            "metadata": hasher(
                client_metadata(body.get("metadata"), trusted=caller.trusted_grader, trusted_keys=trusted_keys)
            ),
        }
        if canary is not None:  # the trace records whether the challenger answered (set here, never by the client)
            traced["metadata"] = {**traced["metadata"], "canary": canary}
        asked = ClientAsked.of(endpoint, body)
        stream = bool(body.get("stream"))
        client: httpx.AsyncClient = app.state.client
        upstream_request = client.build_request(
            "POST", path, json=upstream_body(endpoint, body, served), headers=upstream_headers
        )
        trace_headers = {TRACE_HEADER: trace_id}
        ok_headers = dict(trace_headers)
        if trace_prompt(endpoint, body) is not None:  # a batch or token-id prompt is never traced: no feedback on it
            ok_headers[FEEDBACK_HEADER] = signer.issue(trace_id, caller.key_id, user_hash)
        publish_args: _PublishArgs = (
            trace_id,
            endpoint,
            traced,
            public,
            served,
            version,
            user_hash,
            key_hash(caller.key_id),
            max_tokens,
            link,
            prompt_hash,
        )

        if stream:
            try:
                upstream = await client.send(upstream_request, stream=True)
            except httpx.TransportError as err:
                raise _unreachable(err, trace_id) from None
            if upstream.status_code >= 400:
                raw = await _read_error(upstream)
                return _upstream_error(upstream, raw, trace_id, trace_headers)

            traced_stream = FEEDBACK_HEADER in ok_headers
            if traced_stream:
                streams.start(trace_id)

            async def on_close() -> None:
                if traced_stream and streams.end(trace_id):
                    log.info("gateway: stream of trace %s did not complete: not traced, feedback refused", trace_id)
                await upstream.aclose()
                await release()

            return ClosingStream(
                _relay(upstream, asked, publish_args, started),
                on_close,
                media_type="text/event-stream",
                headers=ok_headers,
            )

        async def fetch() -> tuple[httpx.Response, bytes]:
            upstream = await client.send(upstream_request, stream=True)
            try:
                return upstream, await upstream.aread()
            finally:
                await upstream.aclose()

        async def hung_up() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(cfg.disconnect_poll_s)

        work, watch = asyncio.ensure_future(fetch()), asyncio.ensure_future(hung_up())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            watch.cancel()
        if not work.done():  # the client hung up: abort the upstream request (closing its connection aborts vLLM's)
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            log.info("gateway: client of trace %s hung up; upstream request aborted", trace_id)
            return Response(status_code=CLIENT_GONE)
        try:
            upstream, raw = work.result()
        except httpx.TransportError as err:
            raise _unreachable(err, trace_id) from None
        if upstream.status_code >= 400:
            return _upstream_error(upstream, raw, trace_id, trace_headers)
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):  # a JSON array or string is no answer either
            log.error(
                "gateway: upstream %s answered trace %s with a body that is not a JSON object: %r",
                base,
                trace_id,
                raw[:200],
            )
            raise RequestRefused(
                502,
                "the model server answered with a body that is not JSON (or not a JSON object)",
                type_="upstream_error",
            )
        completion = Completion()
        completion.add_payload(endpoint, payload, delta=False)
        strip_extras(payload, asked)
        task = BackgroundTask(publish, *publish_args, completion, False, started)
        return JSONResponse(payload, headers=ok_headers, background=task)

    def _upstream_error(upstream: httpx.Response, raw: bytes, trace_id: str, headers: dict[str, str]) -> Response:
        """vLLM's 4xx (the request's fault, in OpenAI's error format) is passed on; a 5xx is the model server's
        own failure: logged with its body (which may hold internal detail) and answered 502."""
        if upstream.status_code < 500:
            return Response(
                raw,
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type", "application/json"),
                headers=headers,
            )
        log.error(
            "gateway: upstream %s answered trace %s with HTTP %d: %r", base, trace_id, upstream.status_code, raw[:500]
        )
        return openai_error(
            502,
            f"the model server failed on this request (HTTP {upstream.status_code}); retry later",
            type_="upstream_error",
            code="upstream_error",
            headers=headers,
        )

    def _unreachable(err: Exception, trace_id: str) -> RequestRefused:
        log.error("gateway: upstream %s failed for trace %s: %s: %s", base, trace_id, type(err).__name__, err)
        return RequestRefused(
            502,
            f"the model server is unreachable or failed mid-response ({type(err).__name__}); retry later",
            type_="upstream_error",
            code="upstream_unreachable",
        )

    async def _read_error(upstream: httpx.Response) -> bytes:
        try:
            return await upstream.aread()
        except httpx.TransportError as err:
            raise _unreachable(err, "-") from None
        finally:
            await upstream.aclose()

    async def _relay(
        upstream: httpx.Response, asked: ClientAsked, publish_args: _PublishArgs, started: float
    ) -> AsyncIterator[bytes]:
        """Pass SSE lines through (extras stripped) while assembling the completion.

        The trace is published when ``[DONE]`` arrives after no error chunk and no ``abort`` / ``error``
        finish reason (else the stream did not complete: no trace, and the response's ``on_close`` marks
        it failed so its feedback token is refused), before that line is passed on:
        a client that hangs up as soon as it reads ``[DONE]`` (the openai client does)
        makes the server cancel this generator, and nothing after the last ``yield``
        would run. A client that hangs up earlier cancels it too; the response's
        ``on_close`` then closes the upstream stream, which aborts the generation.
        """
        trace_id, endpoint = publish_args[0], publish_args[1]
        completion = Completion()
        errored = False
        try:
            async for line in upstream.aiter_lines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    if data == "[DONE]":
                        if not errored and completion.finish_reason not in INCOMPLETE_FINISH:
                            publish(*publish_args, completion, True, started)
                            streams.complete(trace_id)
                    else:
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            chunk = None
                        if isinstance(chunk, dict):
                            if "error" in chunk:
                                errored = True
                                log.warning("gateway: upstream stream error for trace %s: %s", trace_id, chunk["error"])
                            completion.add_payload(endpoint, chunk, delta=True)
                            line = "data: " + json.dumps(strip_extras(chunk, asked), separators=(",", ":"))
                yield (line + "\n").encode()
        except httpx.TransportError as err:
            log.warning("gateway: upstream stream for trace %s broke: %s", trace_id, err)

    def publish(
        trace_id: str,
        endpoint: Endpoint,
        body: dict[str, Any],
        public: str,
        served: str,
        version: str | None,
        user_hash: str,
        key: str,
        max_tokens: int,
        link: TurnLink | None,
        prompt_hash: PromptHash | None,
        completion: Completion,
        stream: bool,
        started: float,
    ) -> None:
        """Build the trace event and queue it (non-blocking); a bad event is logged and counted, never raised.
        A chat answer is remembered, so that the request continuing it links to this trace."""
        answer_hash = prompt_hash.with_answer(completion.answer_message()) if prompt_hash is not None else None
        try:
            event = build_trace(
                trace_id=trace_id,
                endpoint=endpoint,
                body=body,
                public_name=public,
                served_name=served,
                adapter_version=version,
                completion=completion,
                stream=stream,
                latency_ms=(time.perf_counter() - started) * 1000.0,
                user_hash=user_hash,
                key_hash=key,
                max_tokens=max_tokens,
                link=link,
                answer_hash=answer_hash,
            )
        except ValidationError as err:
            TRACE_ERRORS.inc()
            log.error("gateway: trace %s is not a valid trace event: %s", trace_id, err)
            return
        if event is None:
            log.info("gateway: trace %s not published (batch or token-id prompt)", trace_id)
            return
        app.state.publisher.publish_trace(event)
        if answer_hash is not None:
            linker.remember(answer_hash, trace_id)

    return app


def serve_gateway(
    app: FastAPI, host: str, port: int, *, gateway: GatewayConfig | None = None, log_level: str = "info"
) -> None:
    """Serve ``app`` with uvicorn on ``host:port`` until interrupted (runs the lifespan: publisher, client), behind
    the request-head limits of ``gateway`` (:mod:`connectors.edge`: header bytes, count and timeout)."""
    uvicorn.Server(server_config(app, host, port, edge_limits(gateway or GatewayConfig()), log_level=log_level)).run()


def edge_limits(cfg: GatewayConfig) -> EdgeLimits:
    """The gateway's request-head limits (``gateway.max_header_bytes``, ``max_headers``, ``header_timeout_s``)."""
    return EdgeLimits(cfg.max_header_bytes, cfg.max_headers, cfg.header_timeout_s)
