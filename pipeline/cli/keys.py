"""``hourglass keys create|revoke|list``: the gateway's client API keys.

Keys live hashed in ``<state_dir>/gateway-keys.json`` (see
:class:`connectors.gateway.auth.KeyStore`); a running gateway sees changes at its
next request. ``create`` prints the key once; nothing else ever prints it.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Column, Table

from pipeline.cli.common import ConfigOpt, JsonOpt, emit, fail, load

# The key store (connectors.gateway.auth, with the signer's itsdangerous) is imported by each command: the gateway
# role's packages stay out of `hourglass --help` (tests/test_role_imports.py).

keys_app = typer.Typer(
    help="Client API keys of the gateway (stored hashed; a key is shown once, at creation).", no_args_is_help=True
)


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Argument(help="Who the key is for (a client, a grader, 'demo').")],
    trusted_grader: Annotated[
        bool,
        typer.Option(
            "--trusted-grader",
            help="May set buffer.trusted_metadata labels (e.g. reference_answer) and explicit rewards.",
        ),
    ] = False,
    rate_per_min: Annotated[
        int | None, typer.Option("--rate-per-min", min=1, help="Requests per minute (default gateway.rate_per_min).")
    ] = None,
    concurrency: Annotated[
        int | None, typer.Option("--concurrency", min=1, help="Requests in flight (default gateway.concurrency).")
    ] = None,
    tokens_per_min: Annotated[
        int | None,
        typer.Option(
            "--tokens-per-min",
            min=1,
            help="Generation tokens asked per minute, n x max_tokens per request (default gateway.tokens_per_min).",
        ),
    ] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a key and print it once (store it now: only its hash is kept)."""
    from connectors.gateway.auth import KeyStoreError
    from pipeline.cli.gateway import key_store

    cfg = load(config)
    try:
        record, key = key_store(cfg).create(
            name,
            trusted_grader=trusted_grader,
            rate_per_min=rate_per_min,
            concurrency=concurrency,
            tokens_per_min=tokens_per_min,
        )
    except (KeyStoreError, OSError) as err:
        fail(str(err))
        return
    note, default = "", min(cfg.gateway.max_tokens, cfg.serving.max_model_len)  # what the gateway bounds to
    if tokens_per_min is not None and tokens_per_min < default:
        note = (
            f"\n[yellow]a request without max_tokens is charged the gateway's default bound ({default} tokens), "
            f"above this key's {tokens_per_min} tokens per minute: its clients must send max_tokens <= "
            f"{tokens_per_min}[/]"
        )
    emit(
        {**record.public(), "key": key},
        as_json,
        f"key {record.key_id} for {escape(name)}{' (trusted grader)' if trusted_grader else ''}:\n{key}\n"
        "[yellow]shown once; send it as 'Authorization: Bearer <key>'[/]" + note,
    )


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key id (see `keys list`).")],
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Revoke a key: its next request gets 403."""
    from connectors.gateway.auth import KeyStoreError
    from pipeline.cli.gateway import key_store

    cfg = load(config)
    try:
        record = key_store(cfg).revoke(key_id)
    except (KeyStoreError, OSError) as err:
        fail(str(err))
        return
    emit(record.public(), as_json, f"revoked {record.key_id} ({escape(record.name)})")


@keys_app.command("list")
def keys_list(config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """List the keys (ids, names, flags and limits; never secrets or hashes)."""
    from connectors.gateway.auth import KeyStoreError
    from pipeline.cli.gateway import key_store

    cfg = load(config)
    try:
        records = sorted(key_store(cfg).keys().values(), key=lambda k: k.created_at)
    except KeyStoreError as err:
        fail(str(err))
        return
    table = Table(
        Column("key id", no_wrap=True, min_width=12),  # never cut: it is what `keys revoke` takes
        "name",
        "created",
        "trusted grader",
        "rate/min",
        "concurrency",
        "tokens/min",
        "revoked",
    )
    for k in records:
        table.add_row(
            k.key_id,
            escape(k.name),
            k.created_at,
            "yes" if k.trusted_grader else "",
            str(k.rate_per_min or "default"),
            str(k.concurrency or "default"),
            str(k.tokens_per_min or "default"),
            "[red]revoked[/]" if k.revoked else "",
        )
    emit([k.public() for k in records], as_json, table)


def register(app: typer.Typer) -> None:
    """Add the ``keys`` command group to ``app``."""
    app.add_typer(keys_app, name="keys")
