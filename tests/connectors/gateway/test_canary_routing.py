"""The canary split in the gateway's resolver: sticky per routing key, and the share matches the fraction."""

from __future__ import annotations

import math
import uuid

from connectors.gateway.routes import RouteResolver, canary_bucket, Route, write_route


def _resolver(tmp_path, fraction: float | None) -> RouteResolver:
    route = Route("hg-v1", "1", "2026-01-01T00:00:00+00:00")
    if fraction is not None:
        route = Route("hg-v1", "1", "2026-01-01T00:00:00+00:00", "hg-v2", "2", fraction)
    write_route(tmp_path, "hg", route)
    return RouteResolver(tmp_path, "hg", "base", ttl_s=0.0)


def test_share_within_three_sd_of_fraction_and_sticky(tmp_path) -> None:
    fraction, n = 0.2, 2000
    resolver = _resolver(tmp_path, fraction)
    keys = [f"hmac-sha256:{uuid.UUID(int=i).hex}" for i in range(n)]
    first = [resolver.route("hg", k) for k in keys]
    share = sum(r.canary for r in first) / n
    assert abs(share - fraction) <= 3 * math.sqrt(fraction * (1 - fraction) / n), share
    assert all(r == ("hg-v2", "2", True) if r.canary else r == ("hg-v1", "1", False) for r in first)
    assert [resolver.route("hg", k) for k in keys] == first  # the same user always lands on the same side
    assert resolver("hg") == ("hg-v1", "1")  # the plain call is the champion


def test_no_challenger_means_no_canary_flag_and_unknown_names_refused(tmp_path) -> None:
    resolver = _resolver(tmp_path, None)
    assert resolver.route("hg", "any") == ("hg-v1", "1", None)
    other = RouteResolver(tmp_path / "empty", "hg", "base", ttl_s=0.0)
    assert other.route("hg", "k") == ("base", None, None)
    try:
        other.route("nope", "k")
    except KeyError as err:
        assert "nope" in str(err)
    else:
        raise AssertionError("an unknown model name must raise KeyError")


def test_bucket_is_stable_across_processes() -> None:
    assert (
        canary_bucket("user-a") == int.from_bytes(__import__("hashlib").sha256(b"user-a").digest()[:8], "big") % 10000
    )
    assert 0 <= canary_bucket("") < 10000


def test_each_challenger_draws_its_own_half(tmp_path) -> None:
    """Sticky within one canary, re-drawn for the next challenger: the same users are not the canary's half
    every time (with 2000 keys at fraction 0.5 the two draws agree on about half of them, not all)."""
    n = 2000
    keys = [f"hmac-sha256:{uuid.UUID(int=i).hex}" for i in range(n)]
    sides = []
    for version in ("2", "3"):
        write_route(tmp_path, "hg", Route("hg-v1", "1", "2026-01-01T00:00:00+00:00", f"hg-v{version}", version, 0.5))
        resolver = RouteResolver(tmp_path, "hg", "base", ttl_s=0.0)
        first = [resolver.route("hg", k).canary for k in keys]
        assert [resolver.route("hg", k).canary for k in keys] == first  # sticky within the canary
        assert abs(sum(first) / n - 0.5) <= 3 * math.sqrt(0.25 / n)
        sides.append(first)
    agree = sum(a == b for a, b in zip(*sides)) / n
    assert abs(agree - 0.5) <= 3 * math.sqrt(0.25 / n), agree  # independent draws, not the same half
