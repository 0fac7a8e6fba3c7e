"""Typed settings of the connectors: the ``[kafka]`` and ``[buffer]`` sections.

Each field is documented where it is declared; ``pipeline.config`` composes
these models into the full ``hourglass.toml`` schema.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, SecretStr, field_validator, model_validator

from connectors.config_base import Section

_TOPIC_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_topic_name(topic: str) -> str:
    """``topic`` if Kafka accepts it as a topic name, else ValueError saying the rule."""
    if not topic or len(topic) > 249 or set(topic) - _TOPIC_CHARS or topic in {".", ".."}:
        raise ValueError(f"topic {topic!r} is not a legal Kafka topic name ([a-zA-Z0-9._-], 1-249 chars)")
    return topic


class KafkaConfig(Section):
    """Where traces and feedback come from (any Kafka-compatible cluster)."""

    bootstrap_servers: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:19092"],
        min_length=1,
        description="host:port of one or more brokers.",
    )
    embedded: bool = Field(
        default=True,
        description="`hourglass up` starts a local Tansu broker on the first bootstrap address.",
    )
    traces_topic: str = Field(default="hourglass.traces", description="Topic of trace events.")
    feedback_topic: str = Field(default="hourglass.feedback", description="Topic of feedback events.")
    routes_topic: str = Field(
        default="hourglass.routes",
        description="Compacted topic (one partition, key = public model name) the serving controller publishes routes to "
        "when serving.routes_source = 'kafka'; every gateway reads it from the beginning, then follows it.",
    )
    group_id: str = Field(default="hourglass-ingest", min_length=1, description="Consumer group of the ingest workers.")
    partitions: int = Field(default=3, ge=1, le=1024, description="Partitions per topic when Hourglass creates it.")
    replication_factor: int = Field(
        default=1, ge=1, le=16, description="Replicas per partition when Hourglass creates a topic."
    )
    session_timeout_ms: int = Field(default=6000, ge=1000, description="Consumer-group session timeout (ms).")
    heartbeat_interval_ms: int = Field(default=1000, ge=100, description="Consumer heartbeat interval (ms).")
    batch_max_records: int = Field(default=2000, ge=1, description="Records per poll/commit batch at most.")
    batch_timeout_ms: int = Field(default=500, ge=1, description="Longest wait for a batch to fill (ms).")
    request_timeout_ms: int = Field(default=30000, ge=1000, description="Client request timeout (ms).")
    max_record_bytes: int = Field(
        default=1_048_576, ge=1024, description="Larger records are dead-lettered as oversize."
    )
    routes_signing_key: SecretStr | None = Field(
        default=None,
        description="HMAC-SHA256 key of route records on routes_topic (at least 32 characters; set "
        "HOURGLASS_KAFKA__ROUTES_SIGNING_KEY, the same value on the serving controller's service and on every "
        "gateway). Set: the controller signs every record and gateways skip unsigned or badly signed ones. "
        "Unset: records are neither signed nor checked (anyone who can write to the topic can move gateways).",
    )

    @field_validator("bootstrap_servers")
    @classmethod
    def _host_port(cls, servers: list[str]) -> list[str]:
        for server in servers:
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"bootstrap server {server!r} is not host:port with a port in 1..65535")
        return servers

    @field_validator("traces_topic", "feedback_topic", "routes_topic")
    @classmethod
    def _topic_name(cls, topic: str) -> str:
        return check_topic_name(topic)

    @field_validator("routes_signing_key", mode="before")
    @classmethod
    def _routes_key(cls, key: object) -> object:
        if isinstance(key, str) and not key.strip():
            return None  # an empty variable means "not set"
        if isinstance(key, str) and len(key) < 32:
            raise ValueError("routes_signing_key must be at least 32 characters (e.g. `openssl rand -hex 32`)")
        return key

    @model_validator(mode="after")
    def _distinct_topics(self) -> "KafkaConfig":
        if self.traces_topic == self.feedback_topic:
            raise ValueError(f"traces_topic and feedback_topic are both {self.traces_topic!r}; they must differ")
        if self.routes_topic in (self.traces_topic, self.feedback_topic):
            raise ValueError(f"routes_topic {self.routes_topic!r} must differ from the traces and feedback topics")
        return self

    @model_validator(mode="after")
    def _heartbeat_below_session(self) -> "KafkaConfig":
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError(
                f"heartbeat_interval_ms={self.heartbeat_interval_ms} must be at most a third of "
                f"session_timeout_ms={self.session_timeout_ms}"
            )
        return self


Signal = Literal["reward", "thumbs", "rating", "edited", "regenerated"]


class RewardSpec(Section):
    """How feedback signals map to one scalar reward in [-1, 1] (before clipping).

    The first signal present, in ``priority`` order, gives the reward and its
    source: an explicit ``reward`` is taken as is; ``thumbs`` up/down maps to
    ``thumbs_up`` / ``thumbs_down``; a ``rating`` r in 1..5 maps linearly to
    ``(r - 3) / 2``; ``edited`` and ``regenerated`` add their (negative) values.
    """

    priority: list[Signal] = Field(
        default_factory=lambda: list(get_args(Signal)),
        description="Order in which signals are looked for.",
    )
    thumbs_up: float = Field(default=1.0, description="Reward for a thumbs-up.")
    thumbs_down: float = Field(default=-1.0, description="Reward for a thumbs-down.")
    edited: float = Field(default=-0.5, description="Reward when the user edited the answer.")
    regenerated: float = Field(default=-0.5, description="Reward when the user asked for another answer.")
    clip: float = Field(
        default=1.0,
        gt=0,
        description="Rewards are clipped to [-clip, clip]; 1.0 keeps every reward on the thumbs scale "
        "(an explicit reward of 5 counts as a thumbs-up, never as five).",
    )


class ImplicitConfig(Section):
    """Implicit feedback read from what users did next (:mod:`connectors.implicit`): derived per trace at
    snapshot time from the conversation links, each mapped to a reward by its weight. A trace with an
    explicit ``reward``, ``thumbs`` or ``rating`` keeps that reward: explicit feedback wins."""

    enabled: bool = Field(default=True, description="Derive implicit signals in snapshots.")
    window_s: float = Field(
        default=600.0,
        gt=0,
        le=7 * 24 * 3600,
        description="How long after an answer its evidence counts (the next turn, a regeneration, a tool "
        "result), seconds; an answer with none after this long is `abandoned`. A signal whose window has not "
        "closed at snapshot time is absent, never negative.",
    )
    rephrase_similarity: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="A next user message whose word-set Jaccard similarity to the previous user message is at "
        "least this is a rephrase (`rephrased`), below it the user went on (`continued`).",
    )
    continued: float = Field(
        default=0.5, ge=-1, le=1, description="Reward when the user went on with the conversation."
    )
    rephrased: float = Field(default=-0.5, ge=-1, le=1, description="Reward when the user restated the question.")
    regenerated: float = Field(
        default=-0.5, ge=-1, le=1, description="Reward when the same prompt was sent again (another answer asked for)."
    )
    tool_error: float = Field(
        default=-1.0, ge=-1, le=1, description="Reward when a tool call of the answer came back with an error."
    )
    abandoned: float = Field(
        default=0.0,
        ge=-1,
        le=1,
        description="Reward when nothing followed the answer within the window. 0 by default: a satisfied last "
        "turn looks the same (the signal is still recorded in the snapshot's `implicit` column).",
    )

    def weight(self, signal: str) -> float:
        """The reward weight of one implicit signal."""
        return float(getattr(self, signal))


class BufferConfig(Section):
    """The Arrow reward buffer and the dead-letter store."""

    root: str = Field(
        default=".hourglass/buffer",
        min_length=1,
        description="Local folder or a pyarrow.fs URI (s3://bucket/prefix, gs://...) for segments.",
    )
    dead_letter_root: str = Field(
        default=".hourglass/dead-letter", min_length=1, description="Where dead-lettered records go."
    )
    segment_max_rows: int = Field(default=5000, ge=1, description="Rows per segment at most.")
    feedback_join_window_s: float = Field(
        default=3600.0,
        gt=0,
        description="How long feedback waits for its trace (and a trace for its feedback), seconds.",
    )
    retention_hours: float = Field(default=24 * 7, gt=0, description="Hourly partitions older than this are deleted.")
    retention_max_bytes: int = Field(
        default=10 * 1024**3, ge=1024, description="Oldest partitions go first above this size."
    )
    reward: RewardSpec = Field(default_factory=RewardSpec, description="Feedback signal to reward mapping.")
    implicit: ImplicitConfig = Field(
        default_factory=ImplicitConfig, description="Implicit feedback from what users did next."
    )
    user_hash_key: SecretStr = Field(
        default=SecretStr("hourglass-change-me"),
        description="HMAC-SHA256 key for user identifiers in metadata (set HOURGLASS_BUFFER__USER_HASH_KEY in production).",
    )
    user_id_keys: list[str] = Field(
        default_factory=lambda: ["user", "user_id", "userid", "email", "username", "user_email"],
        description="Metadata keys (case-insensitive, at any depth) whose values are replaced by a keyed hash.",
    )
    maintenance_interval_s: float = Field(
        default=60.0,
        gt=0,
        description="How often the ingest worker sweeps unmatched feedback and applies retention, seconds.",
    )
    trusted_metadata: list[str] = Field(
        default_factory=lambda: ["reference_answer"],
        description="Request metadata keys the gateway stores at the top of a trace's metadata (where verifiers read "
        "labels) when the request comes from a trusted-grader API key; from any other key they go under metadata.client.",
    )
    max_event_age_s: float | None = Field(
        default=None,
        gt=0,
        description="Events whose ts is older than this at ingest are dead-lettered as ts_out_of_range, seconds "
        "(default: retention_hours, so nothing is stored that retention would delete at once).",
    )
    max_clock_skew_s: float = Field(
        default=300.0,
        ge=0,
        description="Events whose ts is more than this ahead of the ingest clock are dead-lettered as ts_out_of_range, seconds.",
    )
    max_correction_chars: int = Field(
        default=4096, ge=1, description="Longest feedback correction (characters); longer ones are dead-lettered."
    )
    storage_retry_max_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest wait between retries of a batch the buffer could not store (full disk), seconds.",
    )

    @property
    def event_age_limit_s(self) -> float:
        """``max_event_age_s``, or the retention period when it is not set (seconds)."""
        return self.max_event_age_s if self.max_event_age_s is not None else self.retention_hours * 3600.0

    @field_validator("user_hash_key")
    @classmethod
    def _hash_key_long_enough(cls, key: SecretStr) -> SecretStr:
        if len(key.get_secret_value()) < 16:  # never echo the key itself
            raise ValueError("user_hash_key must be at least 16 characters (an HMAC key; an empty one hides nothing)")
        return key


class GatewayConfig(Section):
    """The OpenAI-compatible gateway: client authentication, request limits, feedback tokens."""

    require_api_key: bool = Field(
        default=True,
        description="Clients must send `Authorization: Bearer <key>` (see `hourglass keys create`). False only for "
        "local tests: every caller is then the untrusted key id 'anonymous'.",
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, description="Larger request bodies get 413 (read with a cap, never buffered whole)."
    )
    max_json_depth: int = Field(default=32, ge=4, le=512, description="Deeper JSON nesting gets 400.")
    max_n: int = Field(
        default=8, ge=1, description="Largest `n` (completions per request), and largest batch of prompts."
    )
    max_tokens: int = Field(
        default=4096,
        ge=1,
        description="Largest `max_tokens` / `max_completion_tokens` (400 above it); also the `max_tokens` the gateway "
        "sends when a request has neither (or null), at most `serving.max_model_len`: every generation is bounded.",
    )
    max_messages: int = Field(default=256, ge=1, description="Most chat messages in one request.")
    max_stop: int = Field(
        default=16, ge=1, description="Most `stop` strings in one request (vLLM searches each at every token)."
    )
    max_stop_chars: int = Field(default=256, ge=1, description="Longest `stop` string, characters.")
    max_prompt_chars: int = Field(
        default=200_000, ge=1, description="Most characters of prompt text (all messages together)."
    )
    max_metadata_bytes: int = Field(
        default=16_384, ge=64, description="Largest request `metadata` object, bytes of compact JSON."
    )
    max_schema_bytes: int = Field(
        default=8192, ge=64, description="Largest `response_format` object (a JSON schema is compiled by vLLM), bytes."
    )
    max_tools: int = Field(
        default=128, ge=1, le=1024, description="Most `tools` (function definitions) offered in one chat request."
    )
    max_tool_schema_bytes: int = Field(
        default=16_384,
        ge=64,
        description="Largest tool definition (`tools[i].function`: name, description and JSON-Schema `parameters`), "
        "bytes of compact JSON. Tool definitions are rendered into the prompt and count toward `max_prompt_chars`.",
    )
    max_tool_calls: int = Field(
        default=128,
        ge=1,
        description="Most tool calls in the assistant messages of one request (all messages together).",
    )
    max_tool_arguments_bytes: int = Field(
        default=16_384,
        ge=16,
        description="Largest `arguments` text of one tool call in an assistant message, bytes (UTF-8).",
    )
    conversation_cache_entries: int = Field(
        default=100_000,
        ge=0,
        description="Answers the gateway remembers to link the next turn of a conversation to the trace it continues "
        "(`parent_trace_id`); the oldest go first. 0: no link at request time (ingest-time linking still applies).",
    )
    conversation_ttl_s: float = Field(
        default=24 * 3600.0,
        gt=0,
        description="How long a remembered answer can be continued and still be linked at request time, seconds.",
    )
    rate_per_min: int = Field(
        default=600, ge=1, description="Requests per minute per API key (token bucket) unless the key sets its own."
    )
    concurrency: int = Field(
        default=16, ge=1, description="Requests in flight per API key unless the key sets its own."
    )
    metrics_token: SecretStr | None = Field(
        default=None,
        description="Bearer token `GET /metrics` needs on the client-facing port (set "
        "HOURGLASS_GATEWAY__METRICS_TOKEN; Prometheus: `authorization: {credentials: ...}`), at least 16 characters: "
        "the metrics name every key's public id and its feedback volume. Unset: /metrics is open, as Prometheus "
        "scrapes expect.",
    )
    tokens_per_min: int = Field(
        default=1_000_000,
        ge=1,
        description="Generation tokens per minute per API key unless the key sets its own (token bucket, bursts up to "
        "this many): a request costs what it may generate, `n` x `max_tokens` (x the prompts of a completions batch; "
        "`max_tokens` as the gateway bounds it), taken when it is admitted. Bounds one key's share of the engine by "
        "the work it asks for, not the number of its requests; 429 with Retry-After when spent, 400 for a request "
        "that alone costs more.",
    )
    feedback_signing_key: SecretStr | None = Field(
        default=None,
        description="HMAC-SHA256 key of feedback tokens (set HOURGLASS_GATEWAY__FEEDBACK_SIGNING_KEY; share it between "
        "gateway replicas). Unset: generated once into <state_dir>/gateway-feedback.key (0600).",
    )
    feedback_token_ttl_s: float = Field(
        default=7 * 24 * 3600.0, gt=0, description="How long a response's feedback token stays valid, seconds."
    )
    upstream_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^/\s]+/?$",
        description="Base URL the gateway sends requests to. Unset: serving.replicas[0]. With several vLLM replicas: "
        "a load-balanced address over all of them (each serves every routed version), e.g. a Kubernetes Service.",
    )
    upstream_timeout_s: float = Field(default=600.0, gt=0, description="Upstream (vLLM) read timeout, seconds.")
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A request body not fully received within this many seconds gets 408 (a client that declares "
        "a body and sends it slowly, or never, holds one of its key's concurrency slots meanwhile).",
    )
    max_header_bytes: int = Field(
        default=65_536,
        ge=4096,
        le=1_048_576,
        description="Longest request line + header block, bytes; beyond it the server answers 431 and closes the "
        "connection while reading, before authentication (an unauthenticated client cannot make it buffer more).",
    )
    max_headers: int = Field(
        default=100,
        ge=16,
        le=10_000,
        description="Most header lines in one request; more get 431 before authentication.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="A connection whose request head (request line + headers) is not complete this many seconds after "
        "it opened, or after its previous response, is closed (408 when part of a head arrived): slowloris clients "
        "trickling header bytes cannot hold connections.",
    )
    disconnect_poll_s: float = Field(
        default=0.25,
        gt=0,
        le=10,
        description="How often a non-streaming request checks that its client is still there, seconds.",
    )

    @field_validator("feedback_signing_key", mode="before")
    @classmethod
    def _signing_key(cls, key: object) -> object:
        if isinstance(key, str) and not key.strip():
            return None  # an empty variable means "not set": the gateway generates one
        if isinstance(key, str) and len(key) < 32:
            raise ValueError("feedback_signing_key must be at least 32 characters (e.g. `openssl rand -hex 32`)")
        return key

    @field_validator("metrics_token", mode="before")
    @classmethod
    def _metrics_token(cls, token: object) -> object:
        if isinstance(token, str) and not token.strip():
            return None  # an empty variable means "not set": /metrics stays open
        if isinstance(token, str) and len(token) < 16:
            raise ValueError("metrics_token must be at least 16 characters (e.g. `openssl rand -hex 16`)")
        return token
