"""Signed registrations: staging serves only versions the service itself registered.

MLflow is not a root of trust: anyone who can write to it can create a model
version, tag it with matching checksums and move ``@champion``. So the service
signs what it registers, and staging refuses a version whose signature does
not verify, whoever moved the alias.

What is signed (:func:`payload`): the served model name, the version's
``hourglass.round_id`` and ``hourglass.candidate``, ``hourglass.base_fingerprint``
and the ``hourglass.sha256`` checksum map (canonical JSON: sorted keys, no
spaces). The checksums pin every artifact byte, so a valid signature on a
version means: these exact files, trained by this service on this base, for
this model. Copying a signature to another version is harmless (it pins the
same files for the same model); changing any signed field breaks it.

The signature is the model-version tag ``hourglass.signature``:
``hmac-sha256:<key id>:<hex digest>``; the key id (12 hex characters of a
SHA-256 of the key) tells which key signed, so a rotation can accept the old
key for verification (``registry.previous_signing_keys``) while
``hourglass models resign`` moves versions to the new one.

The signature is computed by the project's one signer (:mod:`connectors.signing`, itsdangerous) under
its :data:`~connectors.signing.REGISTRY_VERSION` purpose: no salt and no key derivation, so the bytes
are exactly the HMAC-SHA256 of the key over the canonical JSON payload that every version registered
so far carries. That is why this signature keeps its canonical JSON and its tag format while the
feedback tokens and the route records use salted keys: it is persisted in MLflow, and staging checks
it at every reconcile, so any other derivation would make staging refuse (and roll back) every
registered champion at the upgrade.

Why HMAC-SHA256 (RFC 2104) and not Ed25519: the only party
that signs is the service, and the only party that verifies is the same
service's serving controller, which runs in the same process with the same
configuration; a public-key scheme would buy nothing here, while HMAC needs no
extra dependency and its key is one environment variable
(``HOURGLASS_REGISTRY__SIGNING_KEY``). If verifiers ever run where the signing
key must not be (e.g. a separate serving tier), switch to Ed25519 and ship
only the public key there.

Key source (:func:`signing_keys`): ``registry.signing_key``; in the embedded
deployment, when unset, a random key generated once into
``<state_dir>/signing-key`` (mode 0600). A production deployment without the
key is refused by :func:`pipeline.config.secret_problems`.
"""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from connectors.signing import REGISTRY_VERSION, BadSignature, Signer, key_id
from pipeline.config import HourglassConfig
from pipeline.errors import ConfigError, PipelineError
from pipeline.state_secrets import state_secret

TAG_SIGNATURE = "hourglass.signature"
SCHEME = "hmac-sha256"
KEY_FILE = "signing-key"

# The tags that are signed (same names as pipeline.registry.models's TAG_* constants).
_TAG_ROUND = "hourglass.round_id"
_TAG_CANDIDATE = "hourglass.candidate"
_TAG_FINGERPRINT = "hourglass.base_fingerprint"
_TAG_SHA256 = "hourglass.sha256"


class SignatureError(PipelineError, ValueError):
    """A model version's signature is missing, malformed, from an unknown key, or does not match its tags."""


def signing_keys(cfg: HourglassConfig) -> list[bytes]:
    """The keys of this deployment: the signing key first, then old keys accepted for verification.

    Raises:
        ConfigError: production deployment without ``registry.signing_key``.
    """
    if cfg.registry.signing_key is not None:
        current = cfg.registry.signing_key.get_secret_value().encode()
    elif cfg.deployment == "production":
        raise ConfigError(
            "registry.signing_key is not set: a production deployment needs HOURGLASS_REGISTRY__SIGNING_KEY "
            "(e.g. `openssl rand -hex 32`)"
        )
    else:
        current = _state_key(cfg.resolve(cfg.state_dir) / KEY_FILE)
    return [current] + [k.get_secret_value().encode() for k in cfg.registry.previous_signing_keys]


def _state_key(path: Path) -> bytes:
    """The key in ``path``, created (0600, 32 random bytes as hex) on first use (:func:`pipeline.state_secrets.state_secret`)."""
    key = state_secret(path, make=lambda: secrets.token_hex(32))
    if len(key) < 32:
        raise ConfigError(f"{path}: the generated signing key is truncated; delete the file to generate a new one")
    return key.encode()


def payload(model: str, tags: Mapping[str, str]) -> bytes:
    """The canonical bytes a version's signature covers.

    Raises:
        SignatureError: a signed tag is missing or ``hourglass.sha256`` is not a JSON object.
    """
    missing = [t for t in (_TAG_ROUND, _TAG_CANDIDATE, _TAG_FINGERPRINT, _TAG_SHA256) if t not in tags]
    if missing:
        raise SignatureError(f"tags {missing} are missing; only versions registered by Hourglass can be served")
    try:
        checksums = json.loads(tags[_TAG_SHA256])
    except ValueError as err:
        raise SignatureError(f"the {_TAG_SHA256} tag is not JSON: {err}") from err
    if not isinstance(checksums, dict):
        raise SignatureError(f"the {_TAG_SHA256} tag must be a JSON object of file -> sha256")
    body = {
        "model": model,
        "round_id": tags[_TAG_ROUND],
        "candidate": tags[_TAG_CANDIDATE],
        "base_fingerprint": tags[_TAG_FINGERPRINT],
        "sha256": checksums,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(key: bytes, model: str, tags: Mapping[str, str]) -> str:
    """The ``hourglass.signature`` tag value for a version of ``model`` carrying ``tags``.

    Raises:
        SignatureError: a tag to sign is missing or malformed.
    """
    signature = Signer([key], REGISTRY_VERSION).sign(payload(model, tags))
    return f"{SCHEME}:{key_id(key)}:{_hex(signature)}"


def _hex(signature: bytes) -> str:
    """itsdangerous' URL-safe base64 signature as the tag's hex digest (the bytes of the HMAC)."""
    return base64.urlsafe_b64decode(signature + b"=" * (-len(signature) % 4)).hex()


def _b64(digest: str) -> bytes:
    return base64.urlsafe_b64encode(bytes.fromhex(digest)).rstrip(b"=")


def verify(keys: Sequence[bytes], model: str, tags: Mapping[str, str]) -> str:
    """Check the version's ``hourglass.signature`` against ``keys``; returns the id of the key that signed.

    Raises:
        SignatureError: no signature, an unknown scheme or key, or a digest
            that does not match the tags (a tag was changed after signing).
    """
    signature = tags.get(TAG_SIGNATURE)
    if not signature:
        raise SignatureError(
            f"the version has no {TAG_SIGNATURE} tag: it was not registered by this Hourglass service "
            "(or before signing existed: re-sign it with `hourglass models resign VERSION`)"
        )
    scheme, _, rest = signature.partition(":")
    kid, _, digest = rest.partition(":")
    if scheme != SCHEME or not kid or not digest:
        raise SignatureError(f"the {TAG_SIGNATURE} tag is malformed (expected '{SCHEME}:<key id>:<hex>')")
    by_id = {key_id(k): k for k in keys}
    if kid not in by_id:
        raise SignatureError(
            f"the version was signed with key {kid}, which is not this service's key ({key_id(keys[0])}) nor one of "
            "registry.previous_signing_keys"
        )
    signed = payload(model, tags)  # raises for missing or malformed signed tags
    try:
        Signer([by_id[kid]], REGISTRY_VERSION).verify(signed, _b64(digest))
    except (BadSignature, ValueError) as err:  # ValueError: a digest that is not hex
        raise SignatureError(
            f"the signature (key {kid}) does not match the version's tags (model, round, candidate, base fingerprint, "
            "checksums): a tag was changed after registration"
        ) from err
    return kid


def resign(cfg: HourglassConfig, client, model: str, version: str, *, adopt: bool = False) -> dict[str, str]:
    """Re-sign a version with the current signing key (key rotation); returns ``{"model", "version", "was", "now"}``.

    Without ``adopt``, the version's signature must verify with an accepted
    key (the current one or ``registry.previous_signing_keys``): rotation
    never blesses a version nobody signed. ``adopt=True`` signs the tags as
    they are (an unsigned version registered before signing existed): the
    operator vouches for it; staging still checks the files against the
    signed checksums.

    Raises:
        SignatureError: the signature does not verify and ``adopt`` is False, or
            the tags to sign are missing.
        MlflowException: MLflow refused or could not be reached.
    """
    keys = signing_keys(cfg)
    tags = dict(client.get_model_version(model, str(version)).tags)
    try:
        was = verify(keys, model, tags)
    except SignatureError:
        if not adopt:
            raise
        was = "none"
    now = sign(keys[0], model, tags)
    if tags.get(TAG_SIGNATURE) != now:
        client.set_model_version_tag(model, str(version), TAG_SIGNATURE, now)
    return {"model": model, "version": str(version), "was": was, "now": key_id(keys[0])}
