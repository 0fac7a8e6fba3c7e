"""What the status page shows, gathered from the running service and cached briefly.

Every source is read through :class:`ConsoleData`, which keeps each part for a
few seconds (``ttl_s``) so that a page left open by several people does not
hammer MLflow, Kafka or the buffer. A source that fails shows its error on the
page (redacted, see :func:`redact`); it never breaks the page.

Sources: the round store (``/rounds``), :meth:`HourglassService.status`, the
MLflow registry (``@champion`` and its ``hourglass.promoted_reason`` tag, the
round and candidate runs for links), the reward buffer (segment listing for
rows per hour, a snapshot of the last day for the live feedback rate by served
version), the dead-letter store (read incrementally: its files are immutable)
and the consumer group's committed offsets
(:func:`connectors.kafka_admin.consumer_group_lag`).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from pipeline.ops_service import OpsService

log = logging.getLogger(__name__)

PAYLOAD_CHARS = 200  # dead-letter payloads are cut to this many characters
NEWEST_DEAD_LETTERS = 5
FEEDBACK_WINDOW = timedelta(hours=6)  # the live feedback chart looks this far back (a buffer snapshot: keep it short)
MAX_VERSIONS = 8  # the feedback chart shows at most this many versions (the most recent)
LIVE_RATE_WINDOW = timedelta(hours=1)  # hourglass_live_feedback_rate: thumbs-up share over this window

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
_SECRET_PARAM = re.compile(
    r"(?i)\b(token|password|passwd|secret|api[_-]?key|key|sig|signature|access_key)=([^&\s\"']+)"
)
_BEARER = re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]+")


def redact(text: str) -> str:
    """``text`` with URL credentials (``user:pass@``), secret-looking query parameters and bearer
    tokens replaced by ``***`` (for error messages and URIs shown on the page)."""
    text = _USERINFO.sub(r"\g<scheme>***@", text)
    text = _SECRET_PARAM.sub(lambda m: f"{m.group(1)}=***", text)
    return _BEARER.sub("Bearer ***", text)


def mlflow_ui_base(tracking_uri: str) -> str | None:
    """The MLflow UI base URL of ``tracking_uri`` without credentials, query or fragment (None when it is
    not an HTTP server, e.g. a local ``file:`` store, so there is no page to link to)."""
    parts = urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


class _Sources:
    """Cached sources, each refreshed on a worker thread (one refresh in flight per source).

    :meth:`get` returns the cached value while it is younger than ``ttl_s``; otherwise it starts
    (or joins) a refresh and waits for it until ``deadline`` (monotonic seconds). A source that has
    not answered by then gives its last value (or ``default``) and ``stale=True``, so one slow
    broker or MLflow never holds the page longer than the deadline; the refresh goes on and its
    result serves later requests.
    """

    def __init__(self, workers: int = 8) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="console-source")
        self._values: dict[str, tuple[float, Any]] = {}
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()

    def _refresh(self, key: str, compute: Callable[[], Any]) -> Any:
        try:
            value = compute()
            with self._lock:
                self._values[key] = (time.monotonic(), value)
            return value
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def start(self, key: str, ttl_s: float, compute: Callable[[], Any]) -> Future | None:
        """Begin refreshing ``key`` when its value is older than ``ttl_s``; the refresh (None when fresh)."""
        with self._lock:
            hit = self._values.get(key)
            if hit is not None and time.monotonic() - hit[0] < ttl_s:
                return None
            future = self._inflight.get(key)
            if future is None:
                future = self._inflight[key] = self._pool.submit(self._refresh, key, compute)
            return future

    def get(
        self, key: str, ttl_s: float, compute: Callable[[], Any], default: Any, deadline: float
    ) -> tuple[Any, bool]:
        """``(value, stale)``; see the class doc."""
        future = self.start(key, ttl_s, compute)
        if future is not None:
            try:
                return future.result(timeout=max(0.0, deadline - time.monotonic())), False
            except FutureTimeout:
                pass
        with self._lock:
            hit = self._values.get(key)
        return (hit[1] if hit is not None else default), future is not None


def _safe(what: str, call: Callable[[], Any], default: Any) -> tuple[Any, str | None]:
    try:
        return call(), None
    except Exception as err:  # shown on the page, redacted; the page never fails for one source
        log.info("console: %s unavailable: %s", what, err)
        return default, redact(f"{what}: {type(err).__name__}: {err}")[:500]


def _skipped(value: Any) -> dict[str, str]:
    """A record's ``skipped`` (candidate -> why) as the page shows it: anything but a mapping (a record edited
    by hand) shows nothing rather than failing the page."""
    return (
        {str(k): str(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))} if isinstance(value, dict) else {}
    )


def _parse_ts(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


class ConsoleData:
    """Collects and caches the page's data for one service.

    Args:
        service: the running :class:`~pipeline.service.HourglassService`.
        ttl_s: how long the page data and the cheap parts (status, rounds) are reused, seconds.
        wait_s: how long one page build waits for slow sources (broker, MLflow), seconds.
    """

    def __init__(self, service: OpsService, ttl_s: float = 2.0, wait_s: float = 3.0) -> None:
        self.service = service
        self.cfg = service.cfg
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self._sources = _Sources()
        self._page: tuple[float, dict[str, Any]] | None = None
        self._page_lock = threading.Lock()
        self._dead_files: dict[str, tuple[Counter, list[dict[str, Any]]]] = {}  # path -> (by reason, rows)
        self._dead_lock = threading.Lock()

    # -- the whole page -----------------------------------------------------------------

    def collect(self) -> dict[str, Any]:
        """Everything the page shows, as one JSON-able dict (reused for ``ttl_s``; at most about
        ``wait_s`` to build, sources that take longer show their last values and a note)."""
        with self._page_lock:  # built in the caller's thread; concurrent viewers share one build
            if self._page is None or time.monotonic() - self._page[0] >= self.ttl_s:
                self._page = (time.monotonic(), self._collect())
            return self._page[1]

    def _collect(self) -> dict[str, Any]:
        errors: list[str] = []
        plan = {  # source -> (call, default, ttl_s)
            "status": (self.service.status, {}, self.ttl_s),
            "rounds": (lambda: [r.as_dict() for r in self.service.store.list(limit=20)], [], self.ttl_s),
            "MLflow registry": (self._registry, {"models": {}, "runs": {}}, 5.0),
            "live feedback": (self._feedback, {"series": {}, "live": [], "bucket_s": None}, 30.0),
            "buffer listing": (self._hourly, [], 10.0),
            "consumer lag": (self._lag, {}, 5.0),
            "dead letters": (self._dead_letters, {"by_reason": {}, "newest": []}, 10.0),
        }
        if self.service.ingest_worker is None:
            del plan["consumer lag"]  # no ingestion in this process: no group to ask about
        computes = {
            what: (lambda what=what, call=call, default=default: _safe(what, call, default))
            for what, (call, default, _) in plan.items()
        }
        for what, (_, _, ttl_s) in plan.items():  # all refreshes run at once
            self._sources.start(what, ttl_s, computes[what])
        deadline = time.monotonic() + self.wait_s
        got: dict[str, Any] = {"consumer lag": {}}
        for what, (_, default, ttl_s) in plan.items():
            (value, error), stale = self._sources.get(what, ttl_s, computes[what], (default, None), deadline)
            got[what] = value
            if stale:
                errors.append(f"{what}: no answer within {self.wait_s:g} s; showing the last values (still asking)")
            elif error:
                errors.append(error)
        status, rounds, registry = got["status"], got["rounds"], got["MLflow registry"]
        feedback, hourly, lag, dead = (
            got["live feedback"],
            got["buffer listing"],
            got["consumer lag"],
            got["dead letters"],
        )
        ui = mlflow_ui_base(self.cfg.registry.tracking_uri)
        return {
            "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "round_running": status.get("round_running"),
            "next_round_at": status.get("next_round_at"),
            "base_fingerprint": self.service.base_fingerprint,
            "models": self._models(status.get("serving", {}), registry["models"]),
            "canary": canary_view(status.get("canary")),
            "rounds": [self._round_view(r, registry["runs"], ui) for r in rounds],
            "feedback": feedback,
            "ingest": {
                "stats": status.get("ingest", {}),
                "buffer": status.get("buffer", {}),
                "lag": lag,
                "hourly": hourly,
                "dead_letters": dead,
            },
            "mlflow_ui": ui,
            "errors": errors,
        }

    # -- served models --------------------------------------------------------------------

    def _served_models(self) -> list[str]:
        return sorted({c.served_model for c in self.cfg.candidates} | {self.cfg.serving.model_name})

    def _models(self, serving: dict[str, Any], registry: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for model in sorted(set(self._served_models()) | set(serving)):
            st = serving.get(model, {})
            reg = registry.get(model, {})
            replicas = {
                redact(url): (names if isinstance(names, list) else redact(str(names)))
                for url, names in (st.get("replicas") or {}).items()
            }
            out.append(
                {
                    "model": model,
                    "champion": reg.get("champion", st.get("desired")),
                    "serving": st.get("serving"),
                    "promoted": reg.get("promoted"),
                    "promoted_at": reg.get("promoted_at"),
                    "previous": reg.get("previous"),
                    "run_link": reg.get("run_link"),
                    "candidate": reg.get("candidate"),
                    "last_hotload_s": st.get("last_hotload_s"),
                    "last_error": redact(st["last_error"]) if st.get("last_error") else None,
                    "replicas": replicas,
                }
            )
        return out

    def _registry(self) -> dict[str, Any]:
        """Champion, promote tag and run links from MLflow (empty when MLflow is down: checked first, 2 s)."""
        from mlflow.exceptions import MlflowException

        from pipeline.registry.aliases import PREVIOUS_ALIAS, TAG_PROMOTED_BY
        from pipeline.registry.models import TAG_CANDIDATE, TAG_KIND, TAG_ROUND, make_client, mlflow_reachable

        if not mlflow_reachable(self.cfg.registry.tracking_uri):
            raise ConnectionError(f"MLflow at {self.cfg.registry.tracking_uri} does not answer")
        client = make_client(self.cfg)
        ui = mlflow_ui_base(self.cfg.registry.tracking_uri)
        runs: dict[str, dict[str, str]] = {}
        experiment = client.get_experiment_by_name(self.cfg.registry.experiment)
        if experiment is not None:
            for run in client.search_runs(
                [experiment.experiment_id], max_results=200, order_by=["attributes.start_time DESC"]
            ):
                round_id = run.data.tags.get(TAG_ROUND)
                if not round_id:
                    continue
                key = (
                    "round"
                    if run.data.tags.get(TAG_KIND) == "round"
                    else f"candidate:{run.data.tags.get(TAG_CANDIDATE, '')}"
                )
                if ui:
                    runs.setdefault(round_id, {})[key] = (
                        f"{ui}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}"
                    )
        models: dict[str, Any] = {}
        for model in self._served_models():
            info: dict[str, Any] = {}
            try:
                mv = client.get_model_version_by_alias(model, self.cfg.registry.champion_alias)
            except MlflowException:
                models[model] = info  # nothing registered yet: the base serves
                continue
            reason = mv.tags.get(TAG_PROMOTED_BY)
            promoted_at = None
            if reason and " at " in reason:
                reason, promoted_at = reason.rsplit(" at ", 1)
            info.update(
                champion=str(mv.version), promoted=reason, promoted_at=promoted_at, candidate=mv.tags.get(TAG_CANDIDATE)
            )
            if ui and mv.run_id and experiment is not None:
                info["run_link"] = f"{ui}/#/experiments/{experiment.experiment_id}/runs/{mv.run_id}"
            try:
                info["previous"] = str(client.get_model_version_by_alias(model, PREVIOUS_ALIAS).version)
            except MlflowException:
                info["previous"] = None
            models[model] = info
        return {"models": models, "runs": runs}

    # -- rounds ---------------------------------------------------------------------------

    @staticmethod
    def _round_view(record: dict[str, Any], runs: dict[str, dict[str, str]], ui: str | None) -> dict[str, Any]:
        created, finished = _parse_ts(record.get("created_at")), _parse_ts(record.get("finished_at"))
        end = finished or datetime.now(timezone.utc)
        links = runs.get(record["round_id"], {})
        decisions = []
        for model, d in sorted((record.get("decisions") or {}).items()):
            lower = d.get("lower_bounds") or {}
            decisions.append(
                {
                    "model": model,
                    "champion_reward": d.get("champion_reward"),
                    "winner": d.get("winner"),
                    "reason": d.get("reason", ""),
                    "candidates": [
                        {
                            "name": name,
                            "reward": reward,
                            "lower_bound": lower.get(name),
                            "link": links.get(f"candidate:{name}"),
                        }
                        for name, reward in sorted((d.get("candidate_rewards") or {}).items())
                    ],
                    "suites": _suite_rows(d.get("regression") or {}),
                }
            )
        metrics = record.get("metrics") or {}
        return {
            "round_id": record["round_id"],
            "state": record["state"],
            "trigger": record["trigger"],
            "window": f"{record.get('window')} until {str(record['until'])[:64]}"
            if record.get("until")
            else record.get("window"),
            "created_at": record.get("created_at"),
            "duration_s": (end - created).total_seconds() if created else None,
            "finished": finished is not None,
            "reason": record.get("reason", ""),
            "versions": record.get("versions") or {},
            "decisions": decisions,
            "skipped": _skipped(record.get("skipped")),
            "reward_model_auc": metrics.get("reward_model/auc"),
            "rows": metrics.get("data/rows"),
            "link": links.get("round"),
        }

    # -- buffer ---------------------------------------------------------------------------

    def _hourly(self) -> list[dict[str, Any]]:
        """Rows per UTC hour and kind from the segment listing (row counts are in the file names)."""
        from connectors.buffer import RewardBuffer

        counts: dict[str, dict[str, int]] = defaultdict(lambda: {"traces": 0, "feedback": 0})
        for seg in RewardBuffer(self.cfg.buffer).segments():
            counts[seg.hour.isoformat()][seg.kind] += seg.rows
        return [{"hour": hour, **kinds} for hour, kinds in sorted(counts.items())[-48:]]

    def _feedback(self) -> dict[str, Any]:
        """Thumbs-up share (reward > 0 among rewarded traces) by served version over time, from a
        buffer snapshot of the last :data:`FEEDBACK_WINDOW`; plus the last hour's share per
        (served model, version) for ``hourglass_live_feedback_rate``. Versions come from traffic, so the
        gauge keeps only configured served models and versions that are numbers (or the base), at most
        :data:`MAX_VERSIONS` per model (those with the most traces), and the chart the
        :data:`MAX_VERSIONS` most recent ones."""
        from connectors.buffer import RewardBuffer

        now = datetime.now(timezone.utc)
        table = (
            RewardBuffer(self.cfg.buffer)
            .snapshot(now - FEEDBACK_WINDOW, now)
            .select(["ts", "model", "adapter_version", "reward"])
        )
        rows = [r for r in table.to_pylist() if r["reward"] is not None]
        if not rows:
            return {"series": {}, "live": [], "bucket_s": None}
        span = (now - min(r["ts"] for r in rows)).total_seconds()
        bucket_s = next((b for b in (60, 300, 900, 3600) if span / b <= 48), 3600)
        served = set(self._served_models())
        buckets: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        live: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for r in rows:
            version = r["adapter_version"] or "base"
            up = 1 if r["reward"] > 0 else 0
            cell = buckets[version][int(r["ts"].timestamp()) // bucket_s * bucket_s]
            cell[0], cell[1] = cell[0] + up, cell[1] + 1
            numeric = version.isascii() and version.isdigit()  # str.isdigit alone takes "²", "٣"
            if now - r["ts"] <= LIVE_RATE_WINDOW and r["model"] in served and (version == "base" or numeric):
                pair = live[(r["model"], version)]
                pair[0], pair[1] = pair[0] + up, pair[1] + 1
        recent = sorted(buckets, key=lambda v: max(buckets[v]), reverse=True)[:MAX_VERSIONS]
        # Numeric versions are forgeable too: per served model, only the MAX_VERSIONS with the most traces.
        busiest: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for key in sorted(live, key=lambda k: (-live[k][1], k)):
            busiest[key[0]].append(key)
        live = {key: live[key] for keys in busiest.values() for key in keys[:MAX_VERSIONS]}
        series = {v: [[t, up / n, n] for t, (up, n) in sorted(buckets[v].items())] for v in sorted(recent)}
        return {
            "series": series,
            "live": [
                {"model": m, "version": v, "rate": up / n, "traces": n} for (m, v), (up, n) in sorted(live.items())
            ],
            "bucket_s": bucket_s,
        }

    def live_feedback(self) -> list[dict[str, Any]]:
        """``[{model, version, rate, traces}]`` of the last hour (cached 30 s; [] when the buffer is unreadable)."""
        compute = lambda: _safe("live feedback", self._feedback, {"series": {}, "live": [], "bucket_s": None})  # noqa: E731
        (value, _), _ = self._sources.get(
            "live feedback", 30.0, compute, ({"live": []}, None), time.monotonic() + self.wait_s
        )
        return list(value.get("live", []))

    # -- ingestion ------------------------------------------------------------------------

    def _lag(self) -> dict[str, int]:
        from connectors.kafka_admin import consumer_group_lag

        return consumer_group_lag(self.cfg.kafka)

    def _dead_letters(self) -> dict[str, Any]:
        """Counts by reason and the newest few, payloads cut to :data:`PAYLOAD_CHARS` (files read once each)."""
        from connectors.storage import list_files, open_location, read_bytes

        loc = open_location(self.cfg.buffer.dead_letter_root)
        with self._dead_lock:
            for info in list_files(loc, loc.base, ".jsonl"):
                if info.path in self._dead_files:
                    continue
                counts: Counter = Counter()
                rows = []
                # split on \n only: payloads keep U+2028, U+0085, \x0c... raw, which str.splitlines splits on
                for line in read_bytes(loc, info.path).decode("utf-8", errors="replace").split("\n"):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except (ValueError, RecursionError):
                        continue
                    if not isinstance(row, dict):  # a damaged line: skipped, like DeadLetterStore.list
                        continue
                    counts[str(row.get("reason"))] += 1
                    rows.append(_letter_view(row))
                self._dead_files[info.path] = (counts, rows[-NEWEST_DEAD_LETTERS:])
            total: Counter = Counter()
            newest: list[dict[str, Any]] = []
            for path in sorted(self._dead_files, key=lambda p: p.rsplit("/", 1)[-1]):  # names start with the write time
                counts, rows = self._dead_files[path]
                total.update(counts)
                newest.extend(rows)
        return {"by_reason": dict(total.most_common()), "newest": newest[-NEWEST_DEAD_LETTERS:][::-1]}


def _letter_view(row: dict[str, Any]) -> dict[str, Any]:
    payload = row.get("payload")
    if payload is None and row.get("payload_b64") is not None:
        payload = f"(binary, base64) {row['payload_b64']}"
    payload = payload or ""
    return {
        "reason": str(row.get("reason")),
        "detail": redact(str(row.get("detail", "")))[:PAYLOAD_CHARS],
        "where": f"{row.get('topic')}:{row.get('partition')}@{row.get('offset')}",
        "at": row.get("dead_lettered_at"),
        "payload": payload[:PAYLOAD_CHARS] + ("…" if len(payload) > PAYLOAD_CHARS else ""),
    }


def canary_view(status_canary: Any) -> dict[str, str]:
    """``{"<model> canary" | "<model> guard" | "<model> last canary" | ...: one line of text}`` for the page:
    the running canaries and guards, and the last decision of each (``control base`` when the model has no
    champion and the base serves the other side), from ``GET /status``'s ``canary`` entry
    (:meth:`pipeline.canary.monitor.CanaryMonitor.status`); empty when nothing runs or ran."""
    out: dict[str, str] = {}
    for model, entry in sorted((status_canary or {}).items()) if isinstance(status_canary, dict) else []:
        if not isinstance(entry, dict):
            continue
        for part, label in (
            ("canary", "canary"),
            ("guard", "guard"),
            ("last_canary", "last canary"),
            ("last_guard", "last guard"),
        ):
            view = entry.get(part)
            if isinstance(view, dict) and view:
                keys = ("version", "champion_version", "control", "fraction", "decision", "reason", "error")
                shown = {**view, "control": view.get("control") if view.get("control") == "base" else None}
                out[f"{model} {label}"] = "; ".join(f"{k} {shown[k]}" for k in keys if shown.get(k) is not None)
    return out


def _suite_rows(regression: dict[str, Any]) -> list[dict[str, Any]]:
    """A decision's regression verdicts (candidate -> [verdict]) as one row per suite: the champion's score
    and each candidate's score, lower bound of (candidate - champion), tolerance and pass."""
    rows: dict[str, dict[str, Any]] = {}
    for name, verdicts in sorted(regression.items()):
        for v in verdicts if isinstance(verdicts, list) else []:
            row = rows.setdefault(
                v.get("suite", "?"),
                {"suite": v.get("suite", "?"), "champion": v.get("champion_score"), "candidates": []},
            )
            row["candidates"].append(
                {
                    "name": name,
                    "score": v.get("candidate_score"),
                    "lower_bound": v.get("lower_bound"),
                    "tolerance": v.get("tolerance"),
                    "passed": bool(v.get("passed")),
                }
            )
    return list(rows.values())
