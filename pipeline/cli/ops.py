"""Ops commands on top of the service's HTTP API: ``service``, ``retrain``,
``status``, ``rounds list|show``, ``cancel``.

They reach the API at ``api.host:api.port`` of the config, with the token from
``HOURGLASS_API__TOKEN`` or the service's ``<state_dir>/api-token``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline.cli.common import ConfigOpt, JsonOpt, console, fail
from pipeline.config import HourglassConfig
from pipeline.rounds.until import parse_until

rounds_app = typer.Typer(help="Round records.", no_args_is_help=True)


class ApiClient:
    """A thin httpx client for the ops API that turns errors into exit messages."""

    def __init__(self, cfg: HourglassConfig) -> None:
        from pipeline.state_secrets import api_token

        host = "127.0.0.1" if cfg.api.host in ("0.0.0.0", "::") else cfg.api.host
        self.base = f"http://{host}:{cfg.api.port}"
        self._token = None
        self._cfg = cfg
        self._token_fn = lambda: api_token(cfg)
        self.timeout_s = 30.0

    def poll(self, path: str) -> Any:
        """``GET path`` for a follow loop: None when the service does not answer in time or the connection
        breaks (a service busy training on a loaded host), so the caller polls again; otherwise as :meth:`call`."""
        try:
            response = self._send("GET", path)
        except httpx.ConnectError:  # the service is gone: no round to follow
            _fail(f"no Hourglass service at {self.base}; start it with `hourglass service --config FILE`")
        except httpx.TransportError:  # timeouts included
            return None
        return self._read("GET", path, response)

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        # Reads need the token too when the API is not on loopback; sending it always is simplest.
        headers = {"Authorization": f"Bearer {self._token_fn()}"}
        return httpx.request(method, f"{self.base}{path}", headers=headers, timeout=self.timeout_s, **kwargs)

    def _read(self, method: str, path: str, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            _fail(f"{method} {path} → {response.status_code}: {detail}")
        return response.json()

    def call(self, method: str, path: str, *, mutate: bool = False, **kwargs: Any) -> Any:
        try:
            response = self._send(method, path, **kwargs)
        except httpx.ConnectError:
            _fail(f"no Hourglass service at {self.base}; start it with `hourglass service --config FILE`")
        except httpx.TimeoutException:  # a service busy training on a loaded host answers late: say so, no traceback
            _fail(f"{method} {path}: the service at {self.base} did not answer within {self.timeout_s:g} s; retry")
        except httpx.HTTPError as err:
            _fail(f"{method} {path}: {type(err).__name__} talking to {self.base}: {err}")
        return self._read(method, path, response)


def _fail(message: str) -> None:
    fail(message)


def _out(data: Any, as_json: bool) -> bool:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    return as_json


def _round_table(records: list[dict[str, Any]]) -> Table:
    """One row per round; a candidate that sat the round out (``skipped``) is marked, its reason is in
    ``hourglass rounds show``."""
    table = Table("round", "state", "trigger", "candidates", "window", "created", "reason")
    for r in records:
        skipped = r.get("skipped")
        skipped = skipped if isinstance(skipped, dict) else {}
        names = [str(c) for c in r.get("candidates") or []]
        table.add_row(  # every cell as text: a record edited by hand may hold markup or other types
            *(escape(str(r.get(key, ""))) for key in ("round_id", "state", "trigger")),
            escape(",".join(f"{c} (sat out)" if c in skipped else c for c in names)),
            escape(str(r.get("window", "")) + (f" until {str(r['until'])[:64]}" if r.get("until") else "")),
            escape(str(r.get("created_at", ""))),
            escape(str(r.get("reason", ""))[:80]),
        )
    return table


def register(app: typer.Typer, load) -> None:
    """Add the ops commands to the main app; ``load(path)`` loads the config or exits."""

    @app.command()
    def service(config: ConfigOpt = None) -> None:
        """Run the always-on service: ingestion, scheduler, reconcile loop, ops API (Ctrl-C / SIGTERM stops it cleanly)."""
        from pipeline.service import run_service

        run_service(load(config))

    @app.command()
    def retrain(
        config: ConfigOpt = None,
        candidates: Annotated[str | None, typer.Option(help="Comma-separated subset of candidates.")] = None,
        window: Annotated[str | None, typer.Option(help="Data window, e.g. 6h (default: rl.window).")] = None,
        until: Annotated[
            str | None,
            typer.Option(
                help="Replay the window that ended at this past time (ISO 8601 with a time zone, e.g. "
                "2026-12-06T14:00:00Z) instead of the one ending now."
            ),
        ] = None,
        wait: Annotated[bool, typer.Option("--wait", help="Follow the round until it ends.")] = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Trigger a round now (refused while one runs)."""
        names = None
        if candidates is not None:  # "" or "," named no candidate: refuse rather than train them all
            names = [name.strip() for name in candidates.split(",") if name.strip()]
            if not names:
                _fail(f"--candidates {candidates!r} names no candidate; leave the option out to train every candidate")
        if until is not None:  # refused here, before any call, as the API would (the same parser)
            try:
                parse_until(until)
            except ValueError as err:
                _fail(f"--{err}")
        client = ApiClient(load(config))
        body = {"candidates": names, "window": window, "until": until}
        record = client.call("POST", "/rounds", mutate=True, json=body)
        if not wait:
            if not _out(record, as_json):
                console.print(f"round [bold]{record['round_id']}[/] started ({record['state']})")
            return
        last = None
        with console.status(f"round {record['round_id']}") as spinner:
            while record["state"] not in ("done", "no_winner", "failed", "cancelled"):
                if record["state"] != last:
                    console.print(f"  {time.strftime('%H:%M:%S')} {record['state']}")
                    last = record["state"]
                spinner.update(f"round {record['round_id']}: {record['state']}")
                time.sleep(2)
                # a round keeps running when one poll goes unanswered (the service is busy training): poll again
                record = client.poll(f"/rounds/{record['round_id']}") or record
        if not _out(record, as_json):
            console.print(f"round {record['round_id']}: [bold]{record['state']}[/] — {escape(record['reason'])}")
        if record["state"] == "failed":
            raise typer.Exit(1)

    @app.command()
    def status(config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
        """What the service is doing: running round, next round, champions, ingest, buffer."""
        data = ApiClient(load(config)).call("GET", "/status")
        if _out(data, as_json):
            return
        console.print(f"round running: {data['round_running'] or '-'}   next scheduled: {data['next_round_at'] or '-'}")
        for model, st in data.get("serving", {}).items():
            console.print(f"serving {model}: {escape(json.dumps(st, default=str))}")
        for name, worker in (data.get("workers") or {}).items():
            error = f", last error: {escape(str(worker['last_error']))}" if worker.get("last_error") else ""
            console.print(f"worker {name}: {worker['state']} (restarts {worker['restarts']}{error})")
        console.print(f"ingest: {data.get('ingest')}")
        console.print(f"buffer: {data.get('buffer')}")
        if data["recent_rounds"]:
            Console().print(_round_table(data["recent_rounds"]))

    @app.command()
    def cancel(round_id: str, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
        """Ask the running round to stop at its next step."""
        data = ApiClient(load(config)).call("POST", f"/rounds/{round_id}/cancel", mutate=True)
        if not _out(data, as_json):
            console.print(f"cancel requested for {round_id}")

    @rounds_app.command("list")
    def rounds_list(config: ConfigOpt = None, limit: int = 20, as_json: JsonOpt = False) -> None:
        """Recent rounds, newest first."""
        data = ApiClient(load(config)).call("GET", "/rounds", params={"limit": limit})
        if not _out(data, as_json):
            Console().print(_round_table(data))

    @rounds_app.command("show")
    def rounds_show(round_id: str, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
        """One round: states, gate decision, metrics, registered versions."""
        data = ApiClient(load(config)).call("GET", f"/rounds/{round_id}")
        if not _out(data, True if as_json else False):
            Console().print_json(json.dumps(data, default=str))

    app.add_typer(rounds_app, name="rounds")
