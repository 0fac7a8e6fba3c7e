"""The one signer (connectors/signing.py): a salt per purpose, key lists for rotation, and the registry's
signature bytes unchanged from the HMAC every registered version already carries."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from connectors.signing import (
    FEEDBACK_TOKEN,
    REGISTRY_VERSION,
    ROUTE_RECORD,
    BadPayload,
    BadSignature,
    Signer,
    key_id,
)

OLD, NEW = b"o" * 32, b"n" * 32


def test_a_signature_for_one_purpose_never_verifies_for_another_under_the_same_key() -> None:
    routes, feedback = Signer([OLD], ROUTE_RECORD), Signer([OLD], FEEDBACK_TOKEN)
    sig = routes.sign(b"payload")
    assert routes.verify(b"payload", sig) == key_id(OLD)
    with pytest.raises(BadSignature):
        feedback.verify(b"payload", sig)
    with pytest.raises(BadSignature):
        routes.verify(b"payload!", sig)


def test_a_rotated_key_list_signs_with_the_newest_and_still_verifies_the_old() -> None:
    before, after = Signer([OLD], FEEDBACK_TOKEN), Signer([NEW, OLD], FEEDBACK_TOKEN)
    token = before.dumps({"t": "trace-1", "e": 5})
    assert after.loads(token) == {"t": "trace-1", "e": 5}
    assert after.verify(b"x", before.sign(b"x")) == key_id(OLD) and after.verify(b"x", after.sign(b"x")) == key_id(NEW)
    with pytest.raises(BadSignature):
        Signer([NEW], FEEDBACK_TOKEN).loads(token)  # the old key dropped: its tokens stop verifying


def test_tokens_are_plain_url_safe_ascii_and_a_bad_payload_is_told_apart() -> None:
    signer = Signer([NEW], FEEDBACK_TOKEN)
    token = signer.dumps({"t": "x" * 200})  # long and repetitive: never compressed
    payload, _, _ = token.partition(".")
    assert token.isascii() and payload and not token.startswith(".")
    forged = signer._by_key[0].sign(b"not-base64-json!").decode()
    with pytest.raises(BadPayload):
        signer.loads(forged)


def test_the_registry_signature_is_the_plain_hmac_every_registered_version_carries() -> None:
    payload = b'{"candidate":"a","model":"m"}'
    raw = hmac.new(OLD, payload, hashlib.sha256).digest()
    import base64

    assert base64.urlsafe_b64decode(Signer([OLD], REGISTRY_VERSION).sign(payload) + b"=") == raw
