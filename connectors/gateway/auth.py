"""Client API keys, signed feedback tokens and per-key limits of the gateway.

API keys look like ``hg-<key id>-<secret>`` (key id: 12 hex digits; secret:
32 random bytes, URL-safe base64). Only the SHA-256 of the whole key is stored
(a 256-bit random secret needs no salt or slow hash), in one JSON file
(mode 0600, replaced atomically, edits serialised by a lock file) that the
gateway re-reads when it changes, so ``hourglass keys create|revoke`` take
effect at the next request without a restart.

A feedback token binds one response to the caller that received it:
``<payload>.<mac>`` where payload is the URL-safe base64 of the JSON
``{"t": trace_id, "k": key_id, "u": end-user hash, "e": expiry (epoch s)}``
and mac its HMAC-SHA256 (RFC 2104) under the signing key derived for feedback
tokens (:mod:`connectors.signing`, itsdangerous). The gateway verifies the MAC,
the trace id, the caller's key id and the expiry.

Rate limits are token buckets (capacity = the per-minute rate, refilled
continuously); concurrency limits count requests in flight per key.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from connectors import atomic
from connectors.errors import ConnectorError
from connectors.signing import FEEDBACK_TOKEN, BadData, BadSignature, Signer

KEY_PREFIX = "hg"
ANONYMOUS = "anonymous"  # the caller's key id when gateway.require_api_key is false


class AuthError(ConnectorError, PermissionError):
    """A request's credentials are missing, unknown, revoked, or do not cover what it asked for."""


class KeyStoreError(ConnectorError, ValueError):
    """The API key file is unreadable, or a key id does not exist."""


class FeedbackTokenError(AuthError):
    """A feedback token is malformed, forged, expired, or was issued for another trace or key."""


class ApiKey(BaseModel):
    """One client API key as stored (never the secret itself)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key_id: str = Field(pattern=r"^[0-9a-f]{12}$", description="Public id, part of the key; shown by `keys list`.")
    name: str = Field(min_length=1, max_length=128, description="Who the key is for.")
    created_at: str = Field(description="RFC 3339 creation time, UTC.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the whole key string.")
    revoked: bool = Field(default=False, description="A revoked key gets 403.")
    trusted_grader: bool = Field(
        default=False, description="May set buffer.trusted_metadata keys and explicit rewards."
    )
    rate_per_min: int | None = Field(
        default=None, ge=1, description="Requests per minute; None = gateway.rate_per_min."
    )
    concurrency: int | None = Field(default=None, ge=1, description="Requests in flight; None = gateway.concurrency.")
    tokens_per_min: int | None = Field(
        default=None, ge=1, description="Generation tokens asked per minute; None = gateway.tokens_per_min."
    )

    def public(self) -> dict[str, object]:
        """The record without its hash (what `keys list` prints)."""
        return self.model_dump(exclude={"sha256"})


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class KeyStore:
    """API keys in one JSON file (``{"keys": [ApiKey, ...]}``), safe for a CLI and gateways sharing it.

    Args:
        path: the key file, e.g. ``<state_dir>/gateway-keys.json`` (created on the first ``create``).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._keys: dict[str, ApiKey] = {}

    # --- reading -----------------------------------------------------------------------

    def _read(self) -> dict[str, ApiKey]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as err:
            raise KeyStoreError(f"cannot read the API key file {self.path}: {err}") from err
        try:
            data = json.loads(raw)
            keys = [ApiKey.model_validate(k) for k in data["keys"]]
        except (ValueError, KeyError, TypeError, ValidationError) as err:
            raise KeyStoreError(
                f"the API key file {self.path} is not a valid key list ({err}); restore it from a backup"
            ) from err
        return {k.key_id: k for k in keys}

    def keys(self) -> dict[str, ApiKey]:
        """Key id -> record, re-read when the file changed (mtime, size or inode)."""
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        with self._lock:
            if stamp != self._stamp or stamp is None:
                self._keys, self._stamp = self._read(), stamp
            return self._keys

    def authenticate(self, key: str) -> ApiKey:
        """The record of ``key``.

        Raises:
            AuthError: unknown, malformed or revoked key (the message never echoes the key).
        """
        parts = key.split("-", 2)
        if len(parts) != 3 or parts[0] != KEY_PREFIX:
            raise AuthError(
                "the API key is not a Hourglass key (hg-<id>-<secret>); create one with `hourglass keys create`"
            )
        record = self.keys().get(parts[1])
        if record is None or not hmac.compare_digest(record.sha256, _hash(key)):
            raise AuthError("the API key is not valid (unknown key id or wrong secret)")
        if record.revoked:
            raise AuthError(f"the API key {record.key_id} ({record.name}) was revoked; ask for a new one")
        return record

    # --- editing (CLI) -------------------------------------------------------------------

    @contextlib.contextmanager
    def _editing(self) -> Iterator[dict[str, ApiKey]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.path.with_name(self.path.name + ".lock")
        with os.fdopen(os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600), "r+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            keys = self._read()
            yield keys
            body = json.dumps({"keys": [k.model_dump() for k in keys.values()]}, indent=2).encode("utf-8")
            atomic.write_bytes(self.path, body, mode=0o600)

    def create(
        self,
        name: str,
        *,
        trusted_grader: bool = False,
        rate_per_min: int | None = None,
        concurrency: int | None = None,
        tokens_per_min: int | None = None,
    ) -> tuple[ApiKey, str]:
        """A new key: ``(record, key string)``. The key string is returned once and never stored.

        Raises:
            KeyStoreError: ``name`` is empty or longer than 128 characters, or a limit is below 1.
        """
        key_id = secrets.token_hex(6)
        key = f"{KEY_PREFIX}-{key_id}-{secrets.token_urlsafe(32)}"
        try:
            record = ApiKey(
                key_id=key_id,
                name=name,
                created_at=datetime.now(UTC).isoformat(timespec="seconds"),
                sha256=_hash(key),
                trusted_grader=trusted_grader,
                rate_per_min=rate_per_min,
                concurrency=concurrency,
                tokens_per_min=tokens_per_min,
            )
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
            raise KeyStoreError(f"cannot create API key {name[:140]!r}: {problems}") from None
        with self._editing() as keys:
            keys[key_id] = record
        return record, key

    def revoke(self, key_id: str) -> ApiKey:
        """Mark ``key_id`` revoked (kept in the file, so `keys list` still shows it).

        Raises:
            KeyStoreError: no such key id.
        """
        with self._editing() as keys:
            if key_id not in keys:
                raise KeyStoreError(f"no API key with id {key_id!r}; see `hourglass keys list`")
            keys[key_id] = keys[key_id].model_copy(update={"revoked": True})
            return keys[key_id]


def load_or_create_secret(path: str | Path, n_bytes: int = 32) -> bytes:
    """The secret in ``path`` (hex text), generated with mode 0600 when the file does not exist yet."""
    path = Path(path)
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        text = ""
    if not text:
        text = secrets.token_hex(n_bytes)
        atomic.write_bytes(path, text.encode("ascii"), mode=0o600)
    return text.encode("ascii")


@dataclass(frozen=True)
class FeedbackClaims:
    """What a verified feedback token says."""

    trace_id: str
    key_id: str
    user_hash: str
    expires_at: float  # epoch seconds


class FeedbackSigner:
    """Issues and verifies feedback tokens: the claims as compact JSON, signed by the project's signer
    (:mod:`connectors.signing`, itsdangerous, purpose :data:`~connectors.signing.FEEDBACK_TOKEN`: an
    HMAC-SHA256 under a key derived for feedback tokens only).

    Args:
        key: the signing key (``gateway.feedback_signing_key``); anyone holding it can forge tokens.
        ttl_s: token lifetime, seconds.
    """

    def __init__(self, key: bytes | str, ttl_s: float) -> None:
        self._signer = Signer([key], FEEDBACK_TOKEN)
        self.ttl_s = ttl_s

    def issue(self, trace_id: str, key_id: str, user_hash: str, *, now: float | None = None) -> str:
        """A token for the response ``trace_id`` served to ``(key_id, user_hash)``."""
        expires = int((time.time() if now is None else now) + self.ttl_s)
        return self._signer.dumps({"t": trace_id, "k": key_id, "u": user_hash, "e": expires})

    def verify(self, token: str, trace_id: str, key_id: str, *, now: float | None = None) -> FeedbackClaims:
        """The claims of a valid token for ``trace_id`` held by ``key_id``.

        Raises:
            FeedbackTokenError: malformed, bad signature, another trace or key, or expired.
        """
        payload, sep, mac = token.partition(".")
        if not sep or not payload or not mac or len(token) > 2048:
            raise FeedbackTokenError(
                "the feedback token is malformed; send the x-hourglass-feedback-token header of the response as is"
            )
        try:
            if not token.isascii():  # a token is URL-safe base64 and a dot
                raise BadSignature("not ASCII")
            claims = self._signer.loads(token)
        except BadSignature as err:
            raise FeedbackTokenError(
                "the feedback token's signature does not verify (forged, altered, or signed with a rotated key)"
            ) from err
        except BadData as err:
            raise FeedbackTokenError(f"the feedback token's payload is unreadable: {err}") from err
        try:
            out = FeedbackClaims(str(claims["t"]), str(claims["k"]), str(claims["u"]), float(claims["e"]))
        except (ValueError, KeyError, TypeError) as err:
            raise FeedbackTokenError(f"the feedback token's payload is unreadable: {err}") from err
        if out.trace_id != trace_id:
            raise FeedbackTokenError(f"the feedback token was issued for another trace, not {trace_id!r}")
        if out.key_id != key_id:
            raise FeedbackTokenError(
                "the feedback token was issued to another API key; feedback must come from the key that made the request"
            )
        if out.expires_at < (time.time() if now is None else now):
            raise FeedbackTokenError(
                f"the feedback token expired at {datetime.fromtimestamp(out.expires_at, UTC).isoformat()}"
            )
        return out


class RateLimiter:
    """Token buckets per key: ``rate_per_min`` units per minute, bursts up to ``rate_per_min``. The gateway keeps
    two: requests (each costs 1) and generation tokens (a request costs the tokens it may generate)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens, last refill, monotonic s)

    def acquire(self, key_id: str, rate_per_min: int, *, cost: float = 1.0, now: float | None = None) -> float:
        """Take ``cost`` units; returns 0.0 when allowed, else the seconds until they are available (nothing
        taken). A cost above ``rate_per_min`` never fits: the caller refuses it before asking."""
        now = time.monotonic() if now is None else now
        per_s = rate_per_min / 60.0
        with self._lock:
            tokens, last = self._buckets.get(key_id, (float(rate_per_min), now))
            tokens = min(float(rate_per_min), tokens + (now - last) * per_s)
            if tokens >= cost:
                self._buckets[key_id] = (tokens - cost, now)
                return 0.0
            self._buckets[key_id] = (tokens, now)
            return (cost - tokens) / per_s

    def refund(self, key_id: str, rate_per_min: int, cost: float) -> None:
        """Give back ``cost`` units taken for work that did not happen (the bucket never holds more than full)."""
        with self._lock:
            if key_id in self._buckets:
                tokens, last = self._buckets[key_id]
                self._buckets[key_id] = (min(float(rate_per_min), tokens + cost), last)


class ConcurrencyLimiter:
    """Requests in flight per key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}

    def try_enter(self, key_id: str, limit: int) -> bool:
        """Count one more request for ``key_id``; False (nothing counted) when ``limit`` are in flight."""
        with self._lock:
            n = self._in_flight.get(key_id, 0)
            if n >= limit:
                return False
            self._in_flight[key_id] = n + 1
            return True

    def leave(self, key_id: str) -> None:
        """One request of ``key_id`` finished."""
        with self._lock:
            n = self._in_flight.get(key_id, 0) - 1
            if n <= 0:
                self._in_flight.pop(key_id, None)
            else:
                self._in_flight[key_id] = n
