"""The whole ``hourglass.toml`` as one typed, validated object.

Sections: ``kafka``, ``buffer``, ``gateway``, ``otel`` (connectors; ``otel`` is optional, absent = off), ``model``, ``candidates``,
``rl`` (trainer; with ``rl.rollout``, ``rl.update``, ``rl.split``, ``rl.gate``, ``rl.ray``,
``rl.reward_model``), ``schedule``, ``registry``, ``serving``, ``api`` (here).
Top level: ``deployment`` (``embedded`` | ``production``: production refuses
default and placeholder secrets, see :func:`secret_problems`) and ``state_dir``.
Any field may be overridden by an environment variable named
``HOURGLASS_<SECTION>__<FIELD>`` (nested with ``__``), for example
``HOURGLASS_KAFKA__BOOTSTRAP_SERVERS='["broker:9092"]'`` or
``HOURGLASS_API__TOKEN=...``. Environment values win over the file.

:func:`load_config` validates everything at once and raises
:class:`~pipeline.errors.ConfigError` whose ``problems`` list names every
mistake with its field path and the bad value.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from connectors.config import BufferConfig, GatewayConfig, KafkaConfig
from connectors.config_base import Section
from connectors.otel.config import OtelSourceConfig  # not the package: its decoders need the ingest extra
from pipeline.errors import ConfigError
from trainer.config import MOVED_RL_KEYS, CandidateConfig, ModelConfig, RLConfig

ENV_PREFIX = "HOURGLASS_"
MIN_SIGNING_KEY_CHARS = 32
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class ScheduleConfig(Section):
    """When rounds run."""

    cron: str | None = Field(default="0 * * * *", description="Crontab (5 fields, UTC). Hourly by default.")
    interval_s: float | None = Field(default=None, gt=0, description="Run every N seconds instead of on the cron.")
    enabled: bool = Field(default=True, description="False: rounds run only when triggered by hand.")
    misfire_grace_s: int = Field(default=600, ge=1, description="A missed run still starts if this late (coalesced).")
    min_new_traces: int = Field(
        default=1, ge=0, description="A scheduled round is skipped until this many traces arrived since the last round."
    )
    shutdown_grace_s: float = Field(
        default=60.0,
        gt=0,
        le=75,
        description="On SIGTERM/SIGINT, seconds a running round gets to stop at its next boundary before it is settled as "
        "failed. At most 75 s, so that with the ingest flush (30 s) and the reconcile stop (10 s) it fits the units' 120 s stop timeout.",
    )
    pending_retry_interval_s: float = Field(
        default=60.0, gt=0, description="Seconds between retries of registrations left pending by an MLflow outage."
    )

    @field_validator("cron")
    @classmethod
    def _cron(cls, cron: str | None) -> str | None:
        if cron is not None:
            if len(cron.split()) != 5:
                raise ValueError(f"cron {cron!r} must have 5 fields (minute hour day month weekday)")
            from apscheduler.triggers.cron import CronTrigger

            try:  # the trigger the scheduler will build: values and ranges checked here, not at start-up
                CronTrigger.from_crontab(cron, timezone="UTC")
            except ValueError as err:
                raise ValueError(f"cron {cron!r}: {err}") from err
        return cron


class RegistryConfig(Section):
    """The MLflow tracking server and model registry."""

    tracking_uri: str = Field(default="http://127.0.0.1:15000", description="MLflow tracking URI.")
    embedded: bool = Field(default=True, description="`hourglass up` starts a local MLflow server at tracking_uri.")
    experiment: str = Field(default="hourglass", min_length=1, description="MLflow experiment of the rounds.")
    champion_alias: str = Field(
        default="champion", pattern=r"^[a-zA-Z][a-zA-Z0-9_-]*$", description="Alias of the served version."
    )
    signing_key: SecretStr | None = Field(
        default=None,
        description="HMAC-SHA256 key that signs every registered version (tag hourglass.signature); staging serves only "
        "versions whose signature verifies. Set HOURGLASS_REGISTRY__SIGNING_KEY (>= 32 characters, e.g. `openssl rand -hex 32`); "
        "unset in the embedded deployment: generated into <state_dir>/signing-key (0600).",
    )
    previous_signing_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Old signing keys still accepted when verifying (key rotation), never used to sign. "
        "HOURGLASS_REGISTRY__PREVIOUS_SIGNING_KEYS='[\"old-key\"]'; drop them once `hourglass models resign` re-signed every version.",
    )

    @field_validator("signing_key", mode="before")
    @classmethod
    def _signing_key(cls, key: Any) -> Any:
        if isinstance(key, str) and not key.strip():
            return None  # an empty HOURGLASS_REGISTRY__SIGNING_KEY means "not set"
        return key

    @field_validator("signing_key", "previous_signing_keys")
    @classmethod
    def _key_length(cls, key: Any) -> Any:
        for one in key if isinstance(key, list) else [key]:
            if one is not None and len(one.get_secret_value()) < MIN_SIGNING_KEY_CHARS:
                raise ValueError(
                    f"a signing key must be at least {MIN_SIGNING_KEY_CHARS} characters (e.g. `openssl rand -hex 32`)"
                )
        return key


class CanaryConfig(Section):
    """A round's winner first serves a slice of live traffic as ``@challenger``."""

    enabled: bool = Field(
        default=True,
        description="True: a round's winner becomes @challenger, promoted only on live feedback; "
        "False: it becomes @champion at once.",
    )
    alias: str = Field(
        default="challenger", pattern=r"^[a-zA-Z][a-zA-Z0-9_-]*$", description="MLflow alias of the version on canary."
    )
    fraction: float = Field(
        default=0.2,
        ge=0.0001,
        le=0.99,
        description="Share of routing keys (keyed hash of the hashed user id, else of the trace id) sent to the "
        "challenger; in steps of 1/10000, and at most 0.99 so that the champion keeps a side to compare with.",
    )
    min_feedback: int = Field(default=30, ge=1, description="Feedback events each side needs before a promotion.")
    margin: float = Field(
        default=0.05,
        ge=0,
        description="Non-inferiority margin: promote when the challenger's live rate is "
        "not lower than the champion's by more than this (reward units; a rate difference for thumbs).",
    )
    alpha: float = Field(
        default=0.05, gt=0, lt=0.5, description="Error rate of the sequential test (valid at every look)."
    )
    min_observed_lift: float | None = Field(
        default=0.0,
        ge=-1,
        le=1,
        description="A promotion also needs the challenger's observed rate minus the champion's to be at least this "
        "(reward units). 0: never promote a challenger the users rated lower, point estimate, even within the "
        "margin (the canary goes on; one still behind at max_duration_s is aborted). None: the margin alone decides.",
    )
    mixture_sd: float = Field(
        default=0.1,
        ge=1e-4,
        le=1e4,
        description="Standard deviation of the mSPRT normal mixture (effect size it is tuned for, in reward units).",
    )
    max_duration_s: float = Field(
        default=86400.0, gt=0, description="Abort a canary still undecided after this many seconds."
    )
    check_interval_s: float = Field(default=30.0, gt=0, description="How often the service looks at the live evidence.")


class GuardConfig(Section):
    """After a canary promotion, watch the new champion against the previous one's live rate."""

    enabled: bool = Field(
        default=True, description="Roll back automatically when the new champion's live rate drops significantly."
    )
    period_s: float = Field(default=3600.0, gt=0, description="How long after a promotion the guard watches.")
    alpha: float = Field(default=0.05, gt=0, lt=0.5, description="Error rate of the guard's sequential test.")


VLLM_MAX_NUM_SEQS_DEFAULT = 256  # vLLM --max-num-seqs: measured against 64 in docs/benchmarks/vllm-lora.md
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM starts with


class ServingConfig(Section):
    """The vLLM replicas that serve the champion."""

    model_name: str = Field(
        default="hourglass", pattern=r"^[a-zA-Z0-9][a-zA-Z0-9._-]*$", description="Public model name clients ask for."
    )
    replicas: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:18000"], min_length=1, description="Base URLs of vLLM servers."
    )
    embedded: bool = Field(default=True, description="`hourglass up` starts a local vLLM on the first replica's port.")
    base_served_name: str = Field(
        default="base",
        pattern=r"^[a-zA-Z0-9][a-zA-Z0-9._-]*$",
        description="vLLM --served-model-name of the bare base model.",
    )
    max_lora_rank: int = Field(
        default=16,
        ge=1,
        description="vLLM --max-lora-rank: the largest LoRA rank served (every candidate's lora_rank must fit); one of "
        f"vLLM's {', '.join(map(str, VLLM_MAX_LORA_RANKS))} (another stops the server at start-up).",
    )
    max_loras: int = Field(default=4, ge=1, le=256, description="vLLM --max-loras (adapters in one batch).")
    max_model_len: int = Field(default=1024, ge=64, le=1 << 20, description="vLLM --max-model-len.")
    max_num_seqs: int = Field(
        default=VLLM_MAX_NUM_SEQS_DEFAULT,
        ge=1,
        le=4096,
        description="The embedded vLLM's --max-num-seqs: sequences decoded together in one engine step. A round sends every "
        "candidate's rollouts and every version's evaluation answers at once; 256 against 64 measured 1.13x on "
        "both, the answers identical (docs/benchmarks/vllm-lora.md). Memory stays bounded "
        "by kv_cache_gib: vLLM schedules only what its KV cache holds.",
    )
    kv_cache_gib: int = Field(default=1, ge=1, le=4096, description="VLLM_CPU_KVCACHE_SPACE on CPU hosts, whole GiB.")
    block_size: int = Field(
        default=32,
        ge=32,
        le=1024,
        multiple_of=32,
        description="vLLM --block-size (KV tokens per block). Prefix caching shares whole blocks only, so the n samples "
        "of one prompt share its prefill only for prompts longer than one block; vLLM's CPU default of 128 shares none "
        "of ours. vLLM's CPU attention takes multiples of 32 only (16 stops the server at start-up).",
    )
    cpu_threads: str = Field(
        default="all",
        pattern=r"^(all|auto|[0-9][0-9,-]*)$",
        description="CPU hosts: cores the vLLM worker binds to. 'all' = every core (vLLM's 'auto' keeps one core for its "
        "API server, half the compute on a 2-core host), 'auto' = vLLM's default, or a list such as '0-3'.",
    )
    startup_timeout_s: float = Field(default=300.0, gt=0, description="How long vLLM may take to become healthy.")
    tool_call_parser: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9_]+$",
        description="The embedded vLLM's tool parser (`--enable-auto-tool-choice --tool-call-parser`), the one that "
        "fits the model's chat template: `hermes` for ChatML `<tool_call>` blocks (`model.chat_template = "
        '"chatml-tools"`, Qwen2.5, Hermes models), `llama3_json`, `mistral`, `pythonic`... Unset: `tool_choice` '
        "`auto` is refused by vLLM (400), `required` and a named tool still work (guided decoding).",
    )
    reconcile_interval_s: float = Field(
        default=10.0,
        gt=0,
        description="Seconds between passes of the reconcile loop (MLflow aliases -> what each vLLM replica serves).",
    )
    drain_s: float = Field(
        default=5.0,
        ge=0,
        description="Seconds a replaced version stays loaded after the route moved off it (requests in flight finish).",
    )
    staging_dir: str | None = Field(
        default=None, description="Where adapters are staged before a load (default: <state_dir>/staging)."
    )
    routes_source: Literal["file", "kafka"] = Field(
        default="file",
        description="Where gateways learn routes. 'file': <state_dir>/routes.json (one host: the gateway shares the "
        "service's state dir). 'kafka': the controller also publishes every route change to the compacted "
        "kafka.routes_topic and each gateway follows it (any number of gateways, no shared disk).",
    )
    adapter_share_uri: str | None = Field(
        default=None,
        description="Shared adapter store (a path, or an s3:// / gs:// URI) for replicas that do not share the service's "
        "disk: a verified version is published there and each replica fetches it through the Hourglass LoRA resolver "
        "plugin (its HOURGLASS_ADAPTER_SHARE must name the same store). Unset: replicas load the staged folder by path.",
    )
    max_adapter_bytes: int = Field(
        default=512 * 1024**2,
        ge=1024,
        description="Largest adapter staging accepts, bytes: the sum of its files and each file, checked on the sizes MLflow "
        "lists before the download and on disk after it.",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="vLLM's API key (its --api-key / VLLM_API_KEY): the controller sends it as Authorization: Bearer on "
        "every call to a replica, and the gateway as its own upstream key (clients' keys never go upstream). "
        "Set HOURGLASS_SERVING__API_KEY.",
    )
    canary: CanaryConfig = Field(
        default_factory=CanaryConfig, description="Canary of a round's winner on live traffic."
    )
    guard: GuardConfig = Field(default_factory=GuardConfig, description="Automatic rollback after a canary promotion.")

    @field_validator("api_key", mode="before")
    @classmethod
    def _api_key(cls, key: Any) -> Any:
        return None if isinstance(key, str) and not key.strip() else key

    @field_validator("max_lora_rank")
    @classmethod
    def _lora_rank(cls, rank: int) -> int:
        if rank not in VLLM_MAX_LORA_RANKS:
            fits = min(r for r in VLLM_MAX_LORA_RANKS if r >= rank) if rank <= VLLM_MAX_LORA_RANKS[-1] else None
            raise ValueError(
                f"vLLM serves LoRA ranks up to one of {', '.join(map(str, VLLM_MAX_LORA_RANKS))}"
                + (f"; {fits} fits rank {rank}" if fits is not None else "")
            )
        return rank

    @field_validator("replicas")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not re.fullmatch(r"https?://[^/\s]+(:\d+)?/?", url):
                raise ValueError(f"replica {url!r} must be a base URL like http://host:port")
        return [url.rstrip("/") for url in urls]


class ApiConfig(Section):
    """The ops HTTP API and the gateway."""

    host: str = Field(default="127.0.0.1", description="Bind address. Loopback by default; change deliberately.")
    port: int = Field(default=18080, gt=0, lt=65536, description="Ops API port.")
    gateway_port: int = Field(default=18081, gt=0, lt=65536, description="OpenAI-compatible gateway port.")
    token: SecretStr | None = Field(
        default=None,
        description="Bearer token of the ops API (set HOURGLASS_API__TOKEN; default: generated into <state_dir>/api-token). "
        "Needed by every state-changing call, and by the reads (/status, /rounds, /buffer/stats, /readyz details) when "
        "`host` is not a loopback address.",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Extra names the ops API answers to in the Host header (DNS-rebinding defence); always allowed: "
        "127.0.0.1, localhost, ::1 and `host` (unless a wildcard). Other Host headers get 421.",
    )

    max_header_bytes: int = Field(
        default=65_536,
        ge=4096,
        le=1_048_576,
        description="Longest request line + header block of the ops API, bytes; beyond it: 431 and the connection "
        "closes, before the token is checked.",
    )
    max_headers: int = Field(
        default=100, ge=16, le=10_000, description="Most header lines in one ops API request (431)."
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="An ops API connection whose request head is not complete this many seconds after it opened, or "
        "after its previous response, is closed (408 when part of a head arrived).",
    )

    max_body_bytes: int = Field(
        default=65_536,
        ge=1024,
        le=16_777_216,
        description="Largest body of a state-changing ops API call, bytes (413 beyond; read after the token check).",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="A state-changing call's body not fully received within this many seconds gets 408.",
    )

    def loopback(self) -> bool:
        """True when the API binds to a loopback address only (then reads need no token)."""
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")

    def host_names(self) -> set[str]:
        """The Host header names (without port) the API answers to."""
        names = set(LOOPBACK_HOSTS) | {h.lower().strip("[]") for h in self.allowed_hosts}
        if self.host not in ("0.0.0.0", "::", ""):
            names.add(self.host.lower())
        return names

    @field_validator("token", mode="before")
    @classmethod
    def _token(cls, token: Any) -> Any:
        if isinstance(token, str) and not token.strip():
            return None  # an empty HOURGLASS_API__TOKEN means "not set": the service generates one
        if isinstance(token, str) and (len(token) < 16 or token != token.strip()):
            raise ValueError("the API token must be at least 16 characters with no surrounding spaces")
        return token

    @model_validator(mode="after")
    def _ports(self) -> "ApiConfig":
        if self.port == self.gateway_port:
            raise ValueError(f"api.port and api.gateway_port must differ (both {self.port})")
        return self


class HourglassConfig(BaseSettings):
    """Everything in ``hourglass.toml``; see each section's fields."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True, case_sensitive=False
    )

    deployment: Literal["embedded", "production"] = Field(
        default="embedded",
        description="'embedded': the local demo stack; missing secrets are generated into state_dir. 'production': "
        "`hourglass config check` and `hourglass service` refuse default, placeholder or missing secrets "
        "(buffer.user_hash_key, registry.signing_key, api.token when set).",
    )
    state_dir: str = Field(default=".hourglass", description="Local state: logs, pids, job store, round records.")
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    candidates: list[CandidateConfig] = Field(default_factory=lambda: [CandidateConfig(name="default")], min_length=1)
    rl: RLConfig = Field(default_factory=RLConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    otel: OtelSourceConfig | None = Field(
        default=None,
        description="OpenTelemetry GenAI traces from the Collector's Kafka exporter: with this section the ingest "
        "worker also reads `otel.topic` (see the data contracts page). Absent: off.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment first: an env var overrides the same field in the file.
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _cross_section(self) -> "HourglassConfig":
        # Every default that depends on another section is resolved here, once: a round reads the config as is.
        # A candidate without a tenant competes for the public model name.
        filled = [
            c
            if "served_model" in c.model_fields_set
            else c.model_copy(update={"served_model": self.serving.model_name})
            for c in self.candidates
        ]
        object.__setattr__(self, "candidates", filled)  # frozen model: set once, during validation
        if self.serving.staging_dir is None:  # follows state_dir, so two instances never share it
            staged = self.serving.model_copy(update={"staging_dir": str(Path(self.state_dir) / "staging")})
            object.__setattr__(self, "serving", staged)
        if self.rl.rollout.engine == "vllm" and self.rl.rollout.url is None:  # default: the serving vLLM fleet
            fleet = self.rl.rollout.model_copy(
                update={"url": self.serving.replicas[0], "urls": self.rl.rollout.urls or list(self.serving.replicas)}
            )
            object.__setattr__(self, "rl", self.rl.model_copy(update={"rollout": fleet}))
        if (
            self.rl.rollout.adapter_share_uri is None and self.serving.adapter_share_uri is not None
        ):  # trainers publish there too
            object.__setattr__(
                self,
                "rl",
                self.rl.model_copy(
                    update={
                        "rollout": self.rl.rollout.model_copy(
                            update={"adapter_share_uri": self.serving.adapter_share_uri}
                        )
                    }
                ),
            )
        names = [c.name for c in self.candidates]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"candidate names must be unique; repeated: {duplicates}")
        taken = sorted(set(names) & set(self.rl.reward_model.adapter_names))
        if taken:
            raise ValueError(
                f"candidate names {taken} are taken by the reward model's adapters (rl.reward_model.name "
                f"{self.rl.reward_model.name!r}); rename the candidate or the reward model"
            )
        served = {c.served_model for c in self.candidates}
        for suite in self.rl.regression:
            unknown = sorted(set(suite.served_models) - served)
            if unknown:
                raise ValueError(
                    f"rl.regression suite {suite.name!r}: served_models {unknown} have no candidate "
                    f"(candidates compete for {sorted(served)})"
                )
        too_big = [c.name for c in self.candidates if c.lora_rank > self.serving.max_lora_rank]
        if too_big:
            raise ValueError(
                f"candidates {too_big} have lora_rank above serving.max_lora_rank={self.serving.max_lora_rank}"
            )
        return self

    def resolve(self, path: str) -> Path:
        """A config path made absolute: ``~`` expanded, relative to the cwd."""
        return Path(os.path.expanduser(path)).resolve()

    def staging_root(self) -> Path:
        """``serving.staging_dir`` made absolute (validation fills it from ``state_dir`` when unset).

        Raises:
            ConfigError: the config was built without validation and has no staging folder.
        """
        if self.serving.staging_dir is None:
            raise ConfigError(
                "serving.staging_dir is unset: build the config with load_config() or HourglassConfig(...)"
            )
        return self.resolve(self.serving.staging_dir)


_SECRET_FIELDS = {
    "token",
    "user_hash_key",
    "signing_key",
    "previous_signing_keys",
    "api_key",
    "feedback_signing_key",
    "routes_signing_key",
}

DEFAULT_USER_HASH_KEY = "hourglass-change-me"
_PLACEHOLDER = re.compile(r"change[-_]?me|changeme|placeholder|example|replace[-_]?me", re.IGNORECASE)


def secret_problems(cfg: HourglassConfig, role: Literal["service", "gateway"] = "service") -> list[str]:
    """What is wrong with the secrets of a ``deployment = "production"`` config ([] when fine or embedded).

    Refused: the default ``buffer.user_hash_key``; any secret that still looks
    like a placeholder (``change-me...`` as in ``deploy/*.env.example``); for
    the ``service`` role, a missing ``registry.signing_key`` (the gateway never
    gets that key); with ``serving.routes_source = "kafka"``, a missing
    ``kafka.routes_signing_key`` (both roles: unsigned route records could be forged).
    Lengths are checked by the fields themselves.
    ``hourglass config check`` and ``hourglass service`` call this.
    """
    if cfg.deployment != "production":
        return []
    problems = []
    secrets = {
        "buffer.user_hash_key (HOURGLASS_BUFFER__USER_HASH_KEY)": cfg.buffer.user_hash_key,
        "registry.signing_key (HOURGLASS_REGISTRY__SIGNING_KEY)": cfg.registry.signing_key,
        "api.token (HOURGLASS_API__TOKEN)": cfg.api.token,
        "serving.api_key (HOURGLASS_SERVING__API_KEY)": cfg.serving.api_key,
        "gateway.feedback_signing_key (HOURGLASS_GATEWAY__FEEDBACK_SIGNING_KEY)": cfg.gateway.feedback_signing_key,
        "kafka.routes_signing_key (HOURGLASS_KAFKA__ROUTES_SIGNING_KEY)": cfg.kafka.routes_signing_key,
    }
    for name, secret in secrets.items():
        value = secret.get_secret_value() if secret is not None else None
        if value is None:
            if name.startswith("registry.signing_key") and role == "service":
                problems.append(
                    f"{name}: not set; production needs a signing key only the service holds (`openssl rand -hex 32`)"
                )
            elif name.startswith("gateway.feedback_signing_key") and role == "gateway":
                problems.append(
                    f"{name}: not set; production gateways share one feedback-token key (`openssl rand -hex 32`)"
                )
            elif name.startswith("kafka.routes_signing_key") and cfg.serving.routes_source == "kafka":
                problems.append(
                    f"{name}: not set while serving.routes_source = 'kafka'; the controller and every gateway need "
                    "the same key, or any producer on the routes topic can move gateways (`openssl rand -hex 32`)"
                )
        elif value == DEFAULT_USER_HASH_KEY or _PLACEHOLDER.search(value):
            problems.append(f"{name}: still the default or a placeholder; set a random value (`openssl rand -hex 32`)")
    return problems


def config_warnings(cfg: HourglassConfig) -> list[str]:
    """What is legal but unsafe in ``cfg`` (``hourglass config check`` prints these; the exit code stays 0).

    Today: a topology with an external service (production) that keeps the built-in
    ``buffer.user_hash_key``, which is public in the source, so user-id hashes can be reversed by
    hashing guesses (emails, user names).
    """
    from connectors.config import BufferConfig

    out = []
    external = not (cfg.kafka.embedded and cfg.registry.embedded and cfg.serving.embedded)
    if external and cfg.buffer.user_hash_key.get_secret_value() == BufferConfig().user_hash_key.get_secret_value():
        out.append(
            "buffer.user_hash_key is the built-in default (public in the source), with external services: user-id "
            "hashes can be reversed by hashing guesses; set HOURGLASS_BUFFER__USER_HASH_KEY (at least 16 characters)"
        )
    return out


def _moved(loc: tuple[str, ...]) -> str | None:
    """Where a key of the old layout lives now (the flat ``[rl]`` keys, the top-level ``[reward_model]``)."""
    if loc == ("reward_model",):
        return "moved: [reward_model] is now [rl.reward_model] (the same fields; see deploy/reference.toml)"
    if len(loc) == 2 and loc[0] == "rl" and loc[1] in MOVED_RL_KEYS:
        return f"moved: use {MOVED_RL_KEYS[loc[1]]} (see deploy/reference.toml)"
    return None


def _env_source(loc: tuple[str, ...]) -> str | None:
    """The ``HOURGLASS_*`` variable that set the value at ``loc`` (the field's own, or a section's JSON that
    holds it), so a problem names where to look; None when the value came from the file or a default."""
    names = {name.upper() for name in os.environ}
    for depth in range(len(loc), 0, -1):
        name = ENV_PREFIX.upper() + "__".join(part.upper() for part in loc[:depth])
        if name in names:
            return name
    return None


def _describe(error: Mapping[str, Any]) -> str:
    loc = ".".join(str(part) for part in error["loc"]) or "(top level)"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        moved = _moved(tuple(str(part) for part in error["loc"]))
        return f"{loc}: {moved}" if moved else f"{loc}: unknown field (typo?)"
    value = error.get("input")
    shown = repr(value) if not isinstance(value, dict) else "{...}"
    if any(str(part) in _SECRET_FIELDS for part in error["loc"]):
        shown = "<secret>"  # never echo a token or key
    if len(shown) > 120:
        shown = shown[:117] + "..."
    source = _env_source(tuple(str(part) for part in error["loc"]))
    return f"{loc}: {message} (got {shown}{f' from {source}' if source else ''})"


def load_config(path: str | Path | None) -> HourglassConfig:
    """Read, validate and return the configuration.

    Args:
        path: a TOML file, or None for the built-in embedded default.

    Raises:
        ConfigError: the file is missing, is not valid TOML, or fails
            validation; ``problems`` lists every mistake found.
    """
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {str(file)!r} does not exist or is not a file")
        try:
            data = tomllib.loads(file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:  # TOMLDecodeError, or an integer over Python's 4,300 digits
            raise ConfigError(f"{file}: not valid TOML: {err}") from err
        except RecursionError as err:
            raise ConfigError(f"{file}: not valid TOML: arrays or tables nested too deeply") from err
    try:
        return HourglassConfig(**data)
    except ValidationError as err:
        problems = [_describe(e) for e in err.errors()]
        where = str(path) if path else "defaults"
        raise ConfigError(f"{where}: {len(problems)} problem(s) in the configuration", problems) from err
    except SettingsError as err:  # an HOURGLASS_* variable that is not valid JSON for a list/dict field
        raise ConfigError(
            f"environment: {err} (list and table fields take JSON, e.g. HOURGLASS_KAFKA__BOOTSTRAP_SERVERS='[\"host:9092\"]')"
        ) from err
    except RecursionError as err:  # JSON in an HOURGLASS_* variable nested thousands deep
        raise ConfigError("environment: an HOURGLASS_* variable's JSON is nested too deeply") from err
