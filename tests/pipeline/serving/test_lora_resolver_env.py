"""The LoRA resolver plugin's settings: a bad cache size stops the replica with the variable named."""

from __future__ import annotations

import pytest

from pipeline.errors import ConfigError
from pipeline.serving import lora_resolver


@pytest.mark.parametrize("keep", ["abc", "0", "-3", "2.5"])
def test_a_bad_cache_size_is_refused_naming_the_variable(keep: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv(lora_resolver.ENV_SHARE, str(tmp_path / "share"))
    monkeypatch.setenv(lora_resolver.ENV_KEEP, keep)
    # was int("abc") (a bare ValueError traceback) or, for 0 and below, every fetched adapter evicted at each fetch
    with pytest.raises(ConfigError, match=f"HOURGLASS_ADAPTER_CACHE_KEEP={keep!r}"):
        lora_resolver.register()


def test_without_a_share_nothing_is_checked_or_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lora_resolver.ENV_SHARE, raising=False)
    monkeypatch.setenv(lora_resolver.ENV_KEEP, "abc")
    assert lora_resolver.register() is None
