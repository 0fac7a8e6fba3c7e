"""The canary loop: read live feedback from the buffer, decide, move the aliases.

Every ``serving.canary.check_interval_s`` the service calls
:meth:`CanaryMonitor.check_once`. For each served model with a ``@challenger``:

1. once the serving controller routes a share of traffic to it, the start time
   is tagged on the version (``hourglass.canary_started_at``);
2. the evidence is the reward buffer's snapshot since then (traces
   de-duplicated by ``trace_id``, feedback joined; see
   :meth:`connectors.buffer.RewardBuffer.snapshot`), rows of this public
   model with a reward, split by ``adapter_version``: the challenger's vs the
   champion's; with no ``@champion`` yet, vs the base model's (the rows whose
   ``adapter_version`` is null: what the gateway's base route answered), shown
   as the version ``"base"`` (``control`` in the view, the ``version`` label of
   the gauges). Each side's evidence is capped per API key and per user
   (``rl.split.max_key_share`` / ``max_user_share``, :func:`capped_side`), so one
   user asking many questions, or one key with many made-up users, weighs at
   most its share. Thumbs-only feedback is a success rate (reward > 0); anything
   else is the mean reward. Nothing is kept in memory, so a restarted service
   resumes with the same evidence and counts nothing twice;
3. :func:`pipeline.canary.sequential.decide` says promote, abort or continue;
4. the reward-hack monitors (:mod:`pipeline.canary.hack_monitors`, ``[rl.monitors]``) compare both
   sides' served answers, and the round's reward-model prediction with the live difference; one that
   refuses turns the decision into an abort naming it. Promote and abort go through
   :mod:`pipeline.canary.state`, log the evidence to the version's MLflow run (``canary/...`` metrics,
   ``canary/monitor/<name>``) and tag the version.

The guard (``serving.guard``): for ``period_s`` after a canary promotion the new
champion's live rate is compared, with the same test, to the previous
champion's rate measured during the canary (both capped per key and per user
as the canary's sides are), and the answer monitors compare its answers since
the promotion with the previous champion's during the canary; a significant
drop, or a monitor that refuses, rolls back with
:func:`pipeline.registry.aliases.rollback` (what ``hourglass rollback`` runs)
and names the reason.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone

import pyarrow as pa
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from prometheus_client import Counter, Gauge

from pipeline.registry import aliases
from pipeline.canary import hack_monitors, state
from pipeline.canary.sequential import ArmStats, Verdict, decide
from pipeline.config import HourglassConfig
from pipeline.registry.models import make_client
from trainer.data import ANONYMOUS_USER, UNKNOWN_KEY, capped_rows, key_share, row_keys, row_users

log = logging.getLogger(__name__)

FEEDBACK_COUNT = Gauge(
    "hourglass_canary_feedback_count",
    'Live feedback events since the canary started, per served version ("base": the base model, no champion yet).',
    ["served_model", "version"],
)
FEEDBACK_RATE = Gauge(
    "hourglass_canary_feedback_rate",
    "Live success rate (thumbs) or mean reward since the canary started, per served version.",
    ["served_model", "version"],
)
OUTCOMES = Counter(
    "hourglass_canary_outcomes",
    "Canary and guard outcomes: promote, abort, guard_rollback, guard_passed.",
    ["served_model", "outcome"],
)

_THUMBS = {"thumbs", "thumbs_up", "thumbs_down"}  # reward_source of thumbs-only feedback
BASE = "base"  # the control arm's name when the model has no champion (its traces' adapter_version is null)


def _parse(ts: str) -> datetime:
    out = datetime.fromisoformat(ts)
    return out if out.tzinfo else out.replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class LiveReward:
    """One trace's feedback as canary evidence: its reward and ``reward_source``, and who it came from
    (``user``: ``metadata.user_hash``, ``key``: ``metadata.key_hash``; see :func:`trainer.data.row_users`)."""

    trace_id: str
    reward: float
    source: str
    user: str = ANONYMOUS_USER
    key: str = UNKNOWN_KEY


def live_rewards(
    cfg: HourglassConfig, model: str, since: datetime, table: pa.Table | None = None
) -> dict[str | None, list[LiveReward]]:
    """``{adapter_version: [LiveReward, ...]}`` of the public ``model``'s traces with ``ts >= since`` that have a
    reward (buffer snapshot: one row per trace id; ``table``: that snapshot when the caller has read it)."""
    from connectors.buffer import RewardBuffer

    if table is None:
        table = RewardBuffer(cfg.buffer).snapshot(start=since)
    columns = ["trace_id", "model", "adapter_version", "reward", "reward_source"]
    users, keys = row_users(table), row_keys(table)
    out: dict[str | None, list[LiveReward]] = {}
    for i, row in enumerate(table.select(columns).to_pylist()):
        if row["model"] == model and row["reward"] is not None:
            out.setdefault(row["adapter_version"], []).append(
                LiveReward(row["trace_id"], float(row["reward"]), row["reward_source"] or "", users[i], keys[i])
            )
    return out


def capped_side(
    side: list[LiveReward], *, max_user_share: float, max_key_share: float, known_keys: Collection[str] = ()
) -> list[LiveReward]:
    """One side's evidence with each API key's and each user's weight capped (:func:`trainer.data.capped_rows`,
    the rule a round's split uses): no key holds more than ``max_key_share`` of the side's observations and no
    user more than ``max_user_share`` (or an even split when there are fewer users than ``1/share``; with
    ``1/max_key_share`` keys or fewer there is no key cap, :func:`trainer.data.key_share`, counted over this side's
    keys and ``known_keys``, the other side's: as a round counts its whole snapshot's, so a key whose made-up users
    all route to one side is capped there too; a single key or user, e.g. traces without user hashes, is never
    cut). A unit over the cap
    keeps the traces whose SHA-256 of trace id sorts first, not ones it chose.

    Why a weight cap and not one observation per user (the mean of that user's feedback): rows without a
    user hash (native Kafka or OTel producers, callers that send no ``user``) are one user, so one
    observation per user would leave such a canary one observation per side and it could never decide; and
    the thumbs test's variance is that of a success rate over events. Capped, honest traffic (many users of
    similar weight) decides as before, while one user (or one key with many made-up users) asking 60
    questions counts as at most its share."""
    trace_ids = [r.trace_id for r in side]
    keys = [r.key for r in side]
    caps = [(keys, key_share([*keys, *known_keys], max_key_share)), ([r.user for r in side], max_user_share)]
    return [side[i] for i in capped_rows(trace_ids, caps)]


def arm_stats(
    rows: dict[str | None, list[LiveReward]],
    *versions: str | None,
    max_user_share: float = 1.0,
    max_key_share: float = 1.0,
) -> tuple[list[ArmStats], bool]:
    """Stats of each version's rows, each side capped per key and per user (:func:`capped_side`; whether keys
    are capped is decided by the keys of every side); binary (success rate) when every row's feedback is thumbs
    only."""
    keys = {r.key for v in versions for r in rows.get(v, [])}
    picked = [
        capped_side(rows.get(v, []), max_user_share=max_user_share, max_key_share=max_key_share, known_keys=keys)
        for v in versions
    ]
    binary = all(r.source in _THUMBS for side in picked for r in side)
    return [ArmStats.of_rewards([r.reward for r in side], binary=binary) for side in picked], binary


def _evidence(verdict: Verdict, binary: bool, **extra) -> dict:
    return {
        "decision": verdict.decision,
        "reason": verdict.reason,
        "difference": verdict.difference,
        "lower": verdict.lower,
        "upper": verdict.upper,
        "metric": "thumbs_up_rate" if binary else "mean_reward",
        "challenger": asdict(verdict.challenger),
        "champion": asdict(verdict.champion),
        **extra,
    }


class CanaryMonitor:
    """Decides running canaries and guards promotions (see the module doc).

    Args:
        cfg: the whole config (``serving.canary``, ``serving.guard``, ``buffer``, ``registry``).
        models: public model names to watch.
        client: an ``MlflowClient``; default :func:`pipeline.registry.models.make_client`.
        on_change: called with the model name after an alias moved (e.g. wake the reconcile loop).
    """

    def __init__(
        self,
        cfg: HourglassConfig,
        *,
        models: list[str],
        client: MlflowClient | None = None,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.models = models
        self.client = client or make_client(cfg)
        self.on_change = on_change
        self._views: dict[str, dict] = {}
        self._last: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- looks ------------------------------------------------------------------------

    def status(self) -> dict[str, dict]:
        """The last look per model: ``{model: {"canary": view | None, "guard": view | None, "last_canary":
        view | None, "last_guard": view | None}}`` (``last_*``: the last decided one since this process started)."""
        return {m: dict(v) for m, v in self._views.items()}

    def check_once(self) -> dict[str, dict]:
        """One look at every model (canary, then guard); never raises (errors land in the view)."""
        with self._lock:
            for model in self.models:
                view: dict = {}
                for part, look in (("canary", self.check_canary), ("guard", self.check_guard)):
                    try:
                        view[part] = look(model)
                    except Exception as err:  # MLflow or buffer unreadable: report, try again next time
                        log.warning("canary %s of %s: %s", part, model, err)
                        view[part] = {"error": f"{type(err).__name__}: {err}"}
                for part in ("canary", "guard"):  # the last decision stays visible after the canary or guard ended
                    if (view[part] or {}).get("decision") in ("promote", "abort", "rollback", "passed", "ended"):
                        self._last[f"{model}/{part}"] = view[part]
                view["last_canary"], view["last_guard"] = (
                    self._last.get(f"{model}/canary"),
                    self._last.get(f"{model}/guard"),
                )
                self._views[model] = view
        return self.status()

    def check_canary(self, model: str, *, act: bool = True) -> dict | None:
        """Look at ``model``'s canary and act on the decision (``act=False``: only report it,
        as ``hourglass canary status`` does); None when none runs."""
        from connectors.gateway.routes import read_routes

        cfg, canary = self.cfg, self.cfg.serving.canary
        version = state.challenger_version(self.client, cfg, model)
        if version is None:
            return None
        champion = aliases.champion_version(self.client, model, cfg.registry.champion_alias)
        control = champion if champion is not None else BASE  # no champion: the base serves the other side
        view = {"version": version, "champion_version": champion, "control": control, "fraction": canary.fraction}
        mv = self.client.get_model_version(model, version)
        if act and state.TAG_RESULT in mv.tags:  # @challenger set again by hand after an earlier canary: start afresh
            for tag in (state.TAG_RESULT, state.TAG_STARTED):
                if tag in mv.tags:
                    self.client.delete_model_version_tag(model, version, tag)
            mv = self.client.get_model_version(model, version)
        started = mv.tags.get(state.TAG_STARTED)
        if started is None:
            route = read_routes(cfg.resolve(cfg.state_dir)).get(model)
            if route is None or route.challenger_version != version or not act:
                return {
                    **view,
                    "decision": "continue",
                    "reason": "waiting for the serving controller to route traffic to it",
                }
            started = state.mark_started(self.client, model, version)
        try:
            since = _parse(started)
        except ValueError:  # edited in MLflow: evidence cannot be dated, so the canary starts again (never stalls)
            if not act:
                return {**view, "decision": "continue", "reason": f"start tag {started[:64]!r} is not a time"}
            log.warning(
                "canary %s v%s: start tag %r is not a time; its evidence starts now", model, version, started[:64]
            )
            since = _parse(state.mark_started(self.client, model, version, restart=True))
        elapsed = (datetime.now(timezone.utc) - since).total_seconds()
        from connectors.buffer import RewardBuffer

        table = RewardBuffer(cfg.buffer).snapshot(start=since)
        rows = live_rewards(cfg, model, since, table)
        (chall, champ), binary = arm_stats(rows, version, champion, **self._shares())
        verdict = decide(
            chall,
            champ,
            alpha=canary.alpha,
            margin=canary.margin,
            min_feedback=canary.min_feedback,
            tau=canary.mixture_sd,
            elapsed_s=elapsed,
            max_duration_s=canary.max_duration_s,
            control="champion" if champion is not None else "base",
            min_observed_lift=canary.min_observed_lift,
        )
        checks = hack_monitors.canary_checks(
            hack_monitors.served_answers(table, model, **self._shares()),
            version,
            champion,
            verdict,
            binary,
            self._predicted_gain(mv.run_id),
            cfg.rl.monitors,
            max_key_share=cfg.rl.split.max_key_share,
        )
        hacks = [c.reason for c in checks if c.refuses]
        if hacks and verdict.decision != "abort":
            verdict = replace(verdict, decision="abort", reason=f"reward-hack monitor: {'; '.join(hacks)}")
        evidence = _evidence(
            verdict,
            binary,
            version=version,
            champion_version=champion,
            control=control,
            started_at=started,
            elapsed_s=round(elapsed, 1),
            events_before_caps={"challenger": len(rows.get(version, [])), "champion": len(rows.get(champion, []))},
            monitors=hack_monitors.as_view(checks),
        )
        for v, stats in ((version, chall), (control, champ)):
            FEEDBACK_COUNT.labels(model, v).set(stats.n)
            FEEDBACK_RATE.labels(model, v).set(stats.mean)
        if verdict.decision != "continue" and act:
            self._log_run(mv.run_id, evidence)
            move = state.promote_challenger if verdict.decision == "promote" else state.abort_challenger
            move(cfg, model, client=self.client, reason=verdict.reason, evidence=evidence)
            OUTCOMES.labels(model, verdict.decision).inc()
            log.info("canary %s v%s: %s (%s)", model, version, verdict.decision, verdict.reason)
            self._changed(model)
        return {**view, **evidence}

    def check_guard(self, model: str) -> dict | None:
        """Watch a champion promoted by a canary for ``guard.period_s``; roll back on a significant drop."""
        guard_cfg = self.cfg.serving.guard
        if not guard_cfg.enabled:
            return None
        champion = aliases.champion_version(self.client, model, self.cfg.registry.champion_alias)
        if champion is None:
            return None
        mv = self.client.get_model_version(model, champion)
        guard = state.read_json_tag(mv.tags, state.TAG_GUARD)
        if guard is None or state.TAG_GUARD_RESULT in mv.tags:
            return None
        try:
            since, until = _parse(guard["since"]), _parse(guard["until"])
            baseline = ArmStats(**guard["baseline"])
            if not isinstance(guard["previous"], str):
                raise TypeError(f"previous is {type(guard['previous']).__name__}, not a version")
        except (TypeError, KeyError, ValueError) as err:  # edited in MLflow: end the guard, say why, keep serving
            reason = f"guard: the {state.TAG_GUARD} tag cannot be read ({type(err).__name__}: {str(err)[:200]}); ended"
            ended = {"decision": "ended", "reason": reason, "at": state.now_iso()}
            self.client.set_model_version_tag(model, champion, state.TAG_GUARD_RESULT, _dump(ended))
            log.warning("guard of %s v%s: %s", model, champion, reason)
            return ended
        from connectors.buffer import RewardBuffer

        buffer = RewardBuffer(self.cfg.buffer)
        after = buffer.snapshot(start=since)
        (live,), binary = arm_stats(live_rewards(self.cfg, model, since, after), champion, **self._shares())
        verdict = decide(
            live,
            baseline,
            alpha=guard_cfg.alpha,
            margin=0.0,
            min_feedback=2**62,
            tau=self.cfg.serving.canary.mixture_sd,
        )
        # The answer monitors: the new champion's answers since the promotion against the previous champion's
        # during the canary (what the users' rate is compared with too); no reward-model prediction here.
        try:
            started: datetime | None = _parse(mv.tags[state.TAG_STARTED])
        except (KeyError, ValueError):  # none, or edited in MLflow: the monitors wait, the rate test still decides
            started = None
        before = buffer.snapshot(start=started, end=since) if started else after.slice(0, 0)
        answers: dict[str | None, list[hack_monitors.Answer]] = {
            champion: hack_monitors.served_answers(after, model, **self._shares()).get(champion, []),
            guard["previous"]: hack_monitors.served_answers(before, model, **self._shares()).get(guard["previous"], []),
        }
        checks = hack_monitors.canary_checks(
            answers,
            champion,
            guard["previous"],
            verdict,
            binary,
            None,
            self.cfg.rl.monitors,
            max_key_share=self.cfg.rl.split.max_key_share,
        )
        hacks = [c.reason for c in checks if c.refuses]
        evidence = _evidence(
            verdict,
            binary,
            version=champion,
            previous=guard["previous"],
            since=guard["since"],
            until=guard["until"],
            monitors=hack_monitors.as_view(checks),
        )
        FEEDBACK_COUNT.labels(model, champion).set(live.n)
        FEEDBACK_RATE.labels(model, champion).set(live.mean)
        if verdict.decision == "abort" or hacks:
            if verdict.decision == "abort":
                why = f"live rate dropped after the promotion; {verdict.reason.replace('challenger', 'new champion')}"
            else:
                why = f"reward-hack monitor: {'; '.join(hacks)}"
            reason = f"guard: {why}"
            aliases.rollback(self.cfg, model, guard["previous"], client=self.client)
            self.client.set_model_version_tag(
                model,
                champion,
                state.TAG_GUARD_RESULT,
                _dump({"decision": "rollback", "reason": reason, "evidence": evidence, "at": state.now_iso()}),
            )
            self._log_run(mv.run_id, {**evidence, "decision": "guard_rollback"})
            OUTCOMES.labels(model, "guard_rollback").inc()
            log.warning("guard rolled %s back from v%s to v%s: %s", model, champion, guard["previous"], reason)
            self._changed(model)
            return {**evidence, "decision": "rollback", "reason": reason}
        if datetime.now(timezone.utc) >= until:
            self.client.set_model_version_tag(
                model,
                champion,
                state.TAG_GUARD_RESULT,
                _dump({"decision": "passed", "evidence": evidence, "at": state.now_iso()}),
            )
            OUTCOMES.labels(model, "guard_passed").inc()
            return {**evidence, "decision": "passed", "reason": "no significant drop within the guard period"}
        return {**evidence, "decision": "watching", "reason": f"watching until {guard['until']}"}

    # -- helpers ------------------------------------------------------------------------

    def _shares(self) -> dict[str, float]:
        """The per-user and per-key caps of each side's evidence: the round's (``rl.split``)."""
        split = self.cfg.rl.split
        return {"max_user_share": split.max_user_share, "max_key_share": split.max_key_share}

    def _predicted_gain(self, run_id: str | None) -> float | None:
        """The round's reward-model predicted gain of this version (``monitor/reward_model_gain`` on its run);
        None when the round had no reward model or the run cannot be read (the monitor then waits)."""
        if not run_id:
            return None
        try:
            return self.client.get_run(run_id).data.metrics.get(hack_monitors.GAIN_METRIC)
        except Exception as err:  # the run may be gone: the other monitors and the test still decide
            log.warning("canary: no reward-model prediction from run %s: %s", run_id, err)
            return None

    def _changed(self, model: str) -> None:
        if self.on_change is not None:
            self.on_change(model)

    def _log_run(self, run_id: str | None, evidence: dict) -> None:
        """The evidence as ``canary/...`` metrics on the round's run (best effort: the run may be gone)."""
        if not run_id:
            return
        now_ms = int(time.time() * 1000)
        values = {
            "canary/challenger_n": evidence["challenger"]["n"],
            "canary/challenger_rate": evidence["challenger"]["mean"],
            "canary/champion_n": evidence["champion"]["n"],
            "canary/champion_rate": evidence["champion"]["mean"],
            "canary/lower": evidence["lower"],
            "canary/upper": evidence["upper"],
            "canary/promoted": 1.0 if evidence["decision"] == "promote" else 0.0,
            **{f"canary/monitor/{name}": m["drift"] for name, m in (evidence.get("monitors") or {}).items()},
        }
        metrics = [Metric(k, float(v), now_ms, 0) for k, v in values.items() if v is not None and v == v]
        try:
            self.client.log_batch(run_id, metrics=metrics)
            self.client.set_tag(
                run_id, "hourglass.canary_decision", f"{evidence['decision']}: {evidence['reason']}"[:4900]
            )
        except Exception as err:  # the decision stands; the run is only a record
            log.warning("canary evidence not logged to run %s: %s", run_id, err)

    # -- loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Look every ``serving.canary.check_interval_s`` until ``stop`` is set: the target of the
        service's supervised ``canary`` worker (:mod:`pipeline.supervise`), which restarts it with
        backoff if anything here raises. A single look already reports MLflow or buffer errors in its
        view and carries on (:meth:`check_once`)."""
        while not stop.is_set():
            self.check_once()
            stop.wait(self.cfg.serving.canary.check_interval_s)

    def start(self) -> None:
        """:meth:`run` on a plain daemon thread until :meth:`stop` (outside the service, e.g. in tests;
        the service runs it as a supervised worker instead)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, args=(self._stop,), name="hourglass-canary", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None


def _dump(data: dict) -> str:
    return json.dumps(data, default=str)[:4900]
