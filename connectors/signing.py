"""The one signer of the project: HMAC-SHA256 by ``itsdangerous``, one salt per purpose, key lists for rotation.

Three things are signed, each under its own :class:`Purpose` (a salt: a signature made for one purpose
never verifies for another, even under the same key):

- :data:`FEEDBACK_TOKEN`: the gateway's feedback tokens, self-contained (``<claims>.<signature>``,
  :meth:`Signer.dumps` / :meth:`Signer.loads`; :mod:`connectors.gateway.auth`);
- :data:`ROUTE_RECORD`: the route records on the compacted routes topic (a header signature over the
  record's canonical bytes; :mod:`connectors.gateway.route_feed`);
- :data:`REGISTRY_VERSION`: the service's signature on each MLflow model version it registered
  (:mod:`pipeline.registry.signing`). It has no salt and no key derivation: it is persisted on every
  version already registered, so its bytes must stay the HMAC-SHA256 of the key over the canonical JSON
  payload that staging has always checked (a new derivation would make staging refuse, and roll back,
  every champion at the upgrade). That payload names the model, round, candidate, base and checksums,
  and is signed for nothing else.

Keys are given newest first (the first signs; every key verifies, so a rotated-out key keeps verifying
what it signed until it is dropped from the list). Source: itsdangerous' ``Signer`` and
``URLSafeSerializer`` (https://itsdangerous.palletsprojects.com/), HMAC per RFC 2104.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import itsdangerous

BadData = itsdangerous.BadData
"""The root of :class:`BadSignature` and :class:`BadPayload`."""
BadPayload = itsdangerous.BadPayload
"""Raised by :meth:`Signer.loads` for a well-signed token whose content is not a JSON payload."""
BadSignature = itsdangerous.BadSignature
"""Raised by :meth:`Signer.verify` and :meth:`Signer.loads` for a signature no key made (or a malformed one)."""


@dataclass(frozen=True)
class Purpose:
    """What a signature is for: its salt, and whether keys are derived per salt (``hmac``) or used as is (``none``)."""

    salt: str | None
    key_derivation: Literal["hmac", "none"] = "hmac"


FEEDBACK_TOKEN = Purpose("hourglass.feedback-token")
ROUTE_RECORD = Purpose("hourglass.route-record")
REGISTRY_VERSION = Purpose(None, "none")


def key_id(key: bytes | str) -> str:
    """12 hex characters naming a key without revealing it."""
    raw = key.encode("utf-8") if isinstance(key, str) else key
    return hashlib.sha256(b"hourglass-signing-key-id:" + raw).hexdigest()[:12]


class Signer:
    """Signs with ``keys[0]`` and verifies with any of ``keys`` (newest first), for one :class:`Purpose`.

    Raises:
        ValueError: no key given.
    """

    def __init__(self, keys: Sequence[bytes | str], purpose: Purpose) -> None:
        if not keys:
            raise ValueError("a signer needs at least one key")
        self.keys = [k.encode("utf-8") if isinstance(k, str) else k for k in keys]
        self.purpose = purpose
        self._by_key = [self._signer([k]) for k in self.keys]  # one per key: which key verified is reported

    def _signer(self, keys: list[bytes]) -> itsdangerous.Signer:
        return itsdangerous.Signer(
            keys, salt=self.purpose.salt, key_derivation=self.purpose.key_derivation, digest_method=hashlib.sha256
        )

    def sign(self, payload: bytes) -> bytes:
        """The signature of ``payload`` with the newest key (URL-safe base64, ASCII bytes)."""
        return self._by_key[0].get_signature(payload)

    def verify(self, payload: bytes, signature: bytes) -> str:
        """The id (:func:`key_id`) of the key that made ``signature`` over ``payload``.

        Raises:
            BadSignature: no key made it (forged, altered, another purpose, or a key no longer listed).
        """
        for key, signer in zip(self.keys, self._by_key):
            if signer.verify_signature(payload, signature):
                return key_id(key)
        raise BadSignature("the signature does not verify with any of the keys")

    def dumps(self, obj: Any) -> str:
        """A self-contained token: ``obj`` as compact JSON in URL-safe base64, a dot, its signature (ASCII,
        never compressed)."""
        payload = base64.urlsafe_b64encode(json.dumps(obj, separators=(",", ":")).encode("utf-8")).rstrip(b"=")
        return self._by_key[0].sign(payload).decode("ascii")

    def loads(self, token: str) -> Any:
        """The object in a token :meth:`dumps` made with any of the keys.

        Raises:
            BadSignature: a bad signature (or a token without one).
            BadPayload: a good signature over content that is not such a payload.
        """
        raw = token.encode("utf-8")
        for signer in self._by_key:
            try:
                payload = signer.unsign(raw)
                break
            except BadSignature:
                continue
        else:
            raise BadSignature("the token's signature does not verify with any of the keys")
        try:
            return json.loads(base64.urlsafe_b64decode(payload + b"=" * (-len(payload) % 4)))
        except ValueError as err:
            raise BadPayload(f"the token's payload is not base64 JSON: {err}") from err
