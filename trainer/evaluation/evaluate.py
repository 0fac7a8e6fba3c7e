"""The evaluate phase of a round: every candidate and its served model's champion (or the base when
there is none) answer the same held-out rows greedily and are measured with the same yardstick,
``rl.gate.metric`` (:mod:`trainer.evaluation.metrics`), which belongs to the served model and never
depends on a candidate's own training reward. The result, one
:class:`~trainer.types.TenantEvaluation` per served model, is all the gate reads
(:mod:`trainer.evaluation.gate`).

Numbered steps of :func:`evaluate`, in order:

1. the usable held-out rows (the first ``rl.gate.eval_prompts`` the metric can use) and why the round may
   promote nothing (none usable, a reward model at chance);
2. each served model's champion loaded into the adapter store and the engine;
3. greedy answers of every candidate and champion, to the held-out rows and to every regression suite
   (``[[rl.regression]]``, :mod:`trainer.evaluation.regression`) of its served model, in one engine call;
4. the base's log-probs of the candidates' answers (one adapters-off pass: the KL guardrail);
5. per candidate: its per-row values under the metric, KL and length;
6. per served model: the champion's values, the regression suites' scores, the reward-hack monitors'
   readings of every candidate's and the champion's answers (:mod:`trainer.evaluation.monitors`; with a
   reward model, its predicted thumbs-up rate of each side's answers too), and the record the gate reads.

Champions loaded in step 2 are unloaded whatever happens.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainer.adapters.store import AdapterStore
from trainer.config import CandidateConfig, GateMetric, RLConfig, uses_reward_model
from trainer.errors import SuiteError
from trainer.evaluation.measure import GreedySet, greedy_sets, kl_to_base, reference_logprobs
from trainer.evaluation.metrics import GATE_METRICS, HeldOut, feedback_labels, refusal, usable_rows
from trainer.evaluation.monitors import Answer, predicted_rate, read_side
from trainer.evaluation.regression import load_suite, score_suite
from trainer.evaluation.stats import auc
from trainer.model.base import ResidentBase
from trainer.plan import PromptTokens
from trainer.reward_model.phase import RewardPhase
from trainer.rollout.engine import RolloutEngine
from trainer.types import BASE_VERSION
from trainer.types import (
    Comparison,
    EvalResult,
    PhaseBoundary,
    PhaseHook,
    Prompt,
    RoundPhase,
    Sample,
    SuiteScores,
    TenantEvaluation,
)


@dataclass(frozen=True)
class Contestants:
    """Who answers the held-out rows: the candidates (config order) with the engine version each was
    trained to (live in the adapter store and the engine), and per served model the folder of its
    champion adapter (None or absent: the base is champion)."""

    candidates: Sequence[CandidateConfig]
    versions: Mapping[str, str]
    champions: Mapping[str, Path | None]

    @property
    def tenants(self) -> list[str]:
        return sorted({c.served_model for c in self.candidates})


@dataclass(frozen=True)
class Evaluation:
    """What :func:`evaluate` measured: the held-out rows it used (their ids, oldest first), per candidate its :class:`~trainer.types.EvalResult`, per served
    model its :class:`~trainer.types.TenantEvaluation`, and round metrics (``eval/prompts``,
    ``eval/<metric>/<candidate>``, ``eval/<metric>/champion/<tenant>``, and per regression suite
    ``regression/<suite>/<candidate>`` and ``regression/<suite>/champion/<tenant>``, the mean scores;
    undefined values left out)."""

    prompt_ids: tuple[str, ...]
    results: dict[str, EvalResult]
    tenants: dict[str, TenantEvaluation]
    metrics: dict[str, float]
    monitor_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per candidate: its monitors' readings (``monitor/mean_words``, ...) and ``monitor/reward_model_gain``."""


def eval_prompts(heldout: Sequence[Prompt], rl: RLConfig) -> list[Prompt]:
    """The first ``rl.gate.eval_prompts`` held-out rows the gate metric can use; may be empty (the gate then
    promotes nothing). For an AUC metric (``feedback``), the first of each label (:func:`both_labels`)."""
    rows, n = usable_rows(heldout, rl), rl.gate.eval_prompts
    if len(rows) > n and GATE_METRICS[rl.gate.metric].comparison == Comparison.AUC:
        return both_labels(rows, n)
    return rows[:n]


def both_labels(rows: Sequence[Prompt], n: int) -> list[Prompt]:
    """``n`` of ``rows``, oldest first within each label, up to half of them up-voted and half not (the rest
    from the other label when one has fewer), in row order. An AUC ranks up-votes against down-votes, so its
    value does not depend on their ratio, but it needs both: at a low rating rate up-votes are rare, and the
    first ``n`` rows of a window can hold none while later ones do."""
    labels = feedback_labels(rows)
    ups = [i for i, up in enumerate(labels) if up]
    downs = [i for i, up in enumerate(labels) if not up]
    take_ups = min(len(ups), max(n // 2, n - len(downs)))
    return [rows[i] for i in sorted(ups[:take_ups] + downs[: n - take_ups])]


def load_suites(rl: RLConfig, root: Path | None = None) -> dict[str, tuple[Prompt, ...]]:
    """Every ``[[rl.regression]]`` suite's prompts by suite name (:func:`trainer.evaluation.regression.load_suite`), in config order.

    Raises:
        SuiteError: listing every suite that cannot be read.
    """
    out: dict[str, tuple[Prompt, ...]] = {}
    problems: list[str] = []
    for suite in rl.regression:
        try:
            out[suite.name] = load_suite(suite, root)
        except SuiteError as err:
            problems.append(str(err))
    if problems:
        raise SuiteError("; ".join(problems))
    return out


def evaluate(
    base: ResidentBase,
    store: AdapterStore,
    engine: RolloutEngine,
    contestants: Contestants,
    heldout: Sequence[Prompt],
    rl: RLConfig,
    *,
    round_id: str,
    reward: RewardPhase | None = None,
    tokens: PromptTokens | None = None,
    on_phase: PhaseHook | None = None,
    suites: Mapping[str, Sequence[Prompt]] | None = None,
) -> Evaluation:
    """The numbered steps of the module docstring. ``reward``: the round's reward model (trained on the
    train split) and its held-out report; ``tokens``: the round's prompt-token cache; ``suites``: each
    ``[[rl.regression]]`` suite's prompts by name (default: read now, :func:`load_suites`).

    ``on_phase`` is called with ``PhaseBoundary(RoundPhase.EVALUATE, part="greedy")`` before the greedy
    answers and ``PhaseBoundary(RoundPhase.EVALUATE, part="score", candidate=name)`` before each candidate
    is scored; if it raises, the champions loaded here are unloaded and the error propagates.
    No usable held-out row is not an error: every served model keeps its champion, and the record says why.

    Raises:
        SuiteError: a regression suite cannot be read, or its check fails on an answer.
    """
    check: PhaseHook = on_phase or (lambda _boundary: None)
    spec = GATE_METRICS[rl.gate.metric]
    metric = str(rl.gate.metric)
    reward = reward or RewardPhase()
    # 1. the rows and why they may not promote
    rows = eval_prompts(heldout, rl)
    why_not = refusal(rows, len(heldout), rl, reward.model, reward.report)
    tokens = tokens or PromptTokens(base, rl)
    ids = tokens.many(rows)
    labels = tuple(feedback_labels(rows)) if spec.comparison == Comparison.AUC else None
    suite_prompts = load_suites(rl) if suites is None else suites
    suite_ids = {  # the oldest tokens cut so the suite's answers still fit in base.max_seq_len
        s.name: [ids_[-max(1, base.max_seq_len - s.max_new_tokens) :] for ids_ in tokens.many(suite_prompts[s.name])]
        for s in rl.regression
        if s.name in suite_prompts
    }
    # 2. the champions
    tenants = contestants.tenants
    champion_versions, champion_names = _load_champions(store, engine, tenants, contestants.champions, round_id)
    try:
        # 3. greedy answers of every version to the held-out rows and its suites, one engine call
        check(PhaseBoundary(RoundPhase.EVALUATE, part="greedy"))
        versions = dict(contestants.versions)
        everyone = [*versions.values(), *sorted(set(champion_versions.values()))]
        on_suite = {  # each suite's versions: its served models' candidates and champions
            s.name: list(
                dict.fromkeys(
                    [versions[c.name] for c in contestants.candidates if s.applies_to(c.served_model)]
                    + [champion_versions[t] for t in tenants if s.applies_to(t)]
                )
            )
            for s in rl.regression
            if s.name in suite_prompts
        }
        sets = [GreedySet(everyone if rows else [], rows, ids, rl.rollout.max_new_tokens)] + [
            GreedySet(on_suite[s.name], suite_prompts[s.name], suite_ids[s.name], s.max_new_tokens)
            for s in rl.regression
            if s.name in on_suite
        ]
        started = time.perf_counter()
        answered = greedy_sets(engine, sets, rl.seed)
        greedy_s = time.perf_counter() - started
        answers, suite_answers = answered[0], dict(zip(on_suite, answered[1:]))
        held = HeldOut(base, rows, ids, answers, rl, reward.model)
        values = spec.values(held) if rows else (lambda _version: ())
        # the reward model's scores of every version's answers (the reward_gap monitor's round half)
        rm_scores = (
            values
            if rl.gate.metric == GateMetric.REWARD_MODEL
            else GATE_METRICS[GateMetric.REWARD_MODEL].values(held)
            if rows and reward.model is not None
            else None
        )
        rm_rates = {v: predicted_rate(rm_scores(v)) for v in answers} if rm_scores is not None else {}
        # 4. the base's log-probs of the candidates' answers: one adapters-off pass, rows by prompt
        kl_versions = list(
            dict.fromkeys(versions[c.name] for c in contestants.candidates if versions[c.name] in answers)
        )
        started = time.perf_counter()
        base_logprobs = reference_logprobs(base, ids, {v: answers[v] for v in kl_versions})
        kl_pass_s = time.perf_counter() - started
        # 5. each candidate (its adapter live: the feedback metric scores through it)
        results: dict[str, EvalResult] = {}
        for c in contestants.candidates:
            check(PhaseBoundary(RoundPhase.EVALUATE, part="score", candidate=c.name))
            samples = answers.get(versions[c.name], [])
            store.activate(c.name)
            row_values = values(versions[c.name])
            results[c.name] = EvalResult(
                version=versions[c.name],
                samples=tuple(samples),
                rewards=row_values,
                mean_kl=kl_to_base(samples, base_logprobs[versions[c.name]]) if samples else float("nan"),
                mean_length=sum(len(s.token_ids) for s in samples) / len(samples) if samples else float("nan"),
                value=auc(row_values, labels) if labels is not None else None,
            )
        # 6. each served model's champion, the regression suites' scores, the monitors' readings, and what the
        #    gate reads
        evaluations: dict[str, TenantEvaluation] = {}
        # where the phase's time goes: the engine's greedy answers, the trainer's adapters-off pass for the KL
        metrics = {"eval/prompts": float(len(rows)), "eval/greedy_s": greedy_s, "eval/kl_pass_s": kl_pass_s}
        suite_scores = _score_suites(rl, suite_prompts, suite_answers)
        readings = {v: read_side(_answers(rows, answers[v]), rl.monitors) for v in answers}
        for tenant in tenants:
            if tenant in champion_names:
                store.activate(champion_names[tenant])
            champion = values(champion_versions[tenant])
            champion_value = (
                auc(champion, labels)
                if labels is not None
                else (float(np.mean(champion)) if len(champion) else float("nan"))
            )
            label = (
                "base" if champion_versions[tenant] == BASE_VERSION else _champion_label(contestants.champions[tenant])
            )
            evaluations[tenant] = TenantEvaluation(
                served_model=tenant,
                metric=metric,
                unit=spec.unit,
                comparison=spec.comparison,
                candidates={c.name: results[c.name] for c in contestants.candidates if c.served_model == tenant},
                champion=champion,
                champion_value=champion_value,
                champion_label=label,
                labels=labels,
                refusal=why_not,
                regression=_tenant_suites(
                    rl, tenant, contestants, versions, champion_versions[tenant], suite_prompts, suite_scores
                ),
                readings={
                    c.name: readings[versions[c.name]]
                    for c in contestants.candidates
                    if c.served_model == tenant and versions[c.name] in readings
                },
                champion_reading=readings.get(champion_versions[tenant]),
                reward_model_gains={
                    c.name: rm_rates[versions[c.name]] - rm_rates[champion_versions[tenant]]
                    for c in contestants.candidates
                    if c.served_model == tenant and versions[c.name] in rm_rates and could_hack_reward_model(c, rl)
                },
            )
            metrics[f"eval/{metric}/champion/{tenant}"] = champion_value
            if champion_versions[tenant] in readings:
                metrics |= readings[champion_versions[tenant]].as_metrics(f"monitor/champion/{tenant}")
            for name, scored in evaluations[tenant].regression.items():
                metrics[f"regression/{name}/champion/{tenant}"] = float(np.mean(scored.champion))
                metrics |= {f"regression/{name}/{c}": float(np.mean(v)) for c, v in scored.candidates.items()}
        metrics |= {f"eval/{metric}/{name}": r.metric_value for name, r in results.items()}
        monitor_metrics = {
            c.name: _monitor_metrics(c.name, evaluations[c.served_model]) for c in contestants.candidates
        }
        for name, values_ in monitor_metrics.items():
            metrics |= {k.replace("monitor/", f"monitor/{name}/", 1): v for k, v in values_.items()}
    finally:
        for version in champion_versions.values():
            if version != BASE_VERSION:
                engine.unload(version)
        for name in champion_names.values():
            store.delete(name)
    finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
    return Evaluation(tuple(p.prompt_id for p in rows), results, evaluations, finite, monitor_metrics)


def could_hack_reward_model(candidate: CandidateConfig, rl: RLConfig) -> bool:
    """Whether the reward model's love of this candidate's answers could be a hack: it trained on the reward
    model's scores, or the gate chose it by them. Only these get ``monitor/reward_model_gain``, so only these
    face the canary's ``reward_gap`` monitor: a candidate that learned from the users' thumbs alone (``kto`` on
    logged answers) cannot have gamed a reward model it never saw, and a reward model that overrates it is
    miscalibrated, which the canary's own test of the users' votes already judges (in two of four demo runs on
    2026-12-05/06 the monitor aborted round 1's ``kto`` challenger, once while users preferred it 33 % to 12 %)."""
    return uses_reward_model(candidate) or rl.gate.metric == GateMetric.REWARD_MODEL


def _monitor_metrics(name: str, tenant: TenantEvaluation) -> dict[str, float]:
    """A candidate's monitor readings and the reward model's predicted gain over the champion (finite ones)."""
    reading = tenant.readings.get(name)
    out = reading.as_metrics("monitor") if reading is not None else {}
    gain = tenant.reward_model_gains.get(name, float("nan"))
    return out | ({"monitor/reward_model_gain": gain} if math.isfinite(gain) else {})


def _champion_label(folder: str | Path | None) -> str:
    """``champion v3`` for the service's staged champion (``staging/<model>/v3``), else ``champion <folder>``."""
    if folder is None:
        return "champion"
    name = Path(folder).name
    return f"champion {name}" if re.fullmatch(r"v\d+", name) else f"champion {folder}"


def _answers(rows: Sequence[Prompt], samples: Sequence[Sample]) -> list[Answer]:
    """Greedy answers as the monitors read them (the row's messages and metadata, with its tools)."""
    return [
        Answer(p.messages, s.text, {**p.metadata, "tools": p.tools} if p.tools else p.metadata)
        for p, s in zip(rows, samples)
    ]


def _score_suites(
    rl: RLConfig, prompts: Mapping[str, Sequence[Prompt]], answers: Mapping[str, Mapping[str, Sequence[Sample]]]
) -> dict[str, dict[str, tuple[float, ...]]]:
    """Suite name -> version -> the suite check's score of each of its greedy answers."""
    return {
        s.name: {v: score_suite(s, prompts[s.name], a) for v, a in answers[s.name].items()}
        for s in rl.regression
        if s.name in answers
    }


def _tenant_suites(
    rl: RLConfig,
    tenant: str,
    contestants: Contestants,
    versions: Mapping[str, str],
    champion_version: str,
    prompts: Mapping[str, Sequence[Prompt]],
    scores: Mapping[str, Mapping[str, tuple[float, ...]]],
) -> dict[str, SuiteScores]:
    """One served model's regression suites: its champion's and candidates' scores (suites it faces)."""
    out = {}
    for s in rl.regression:
        if not s.applies_to(tenant) or s.name not in scores:
            continue
        by_version = scores[s.name]
        out[s.name] = SuiteScores(
            suite=s.name,
            prompt_ids=tuple(p.prompt_id for p in prompts[s.name]),
            champion=by_version[champion_version],
            candidates={
                c.name: by_version[versions[c.name]] for c in contestants.candidates if c.served_model == tenant
            },
        )
    return out


def _load_champions(
    store: AdapterStore,
    engine: RolloutEngine,
    tenants: Sequence[str],
    champions: Mapping[str, Path | None],
    round_id: str,
) -> tuple[dict[str, str], dict[str, str]]:
    """Each tenant's champion as an adapter in the store and the engine: tenant -> engine version
    (``BASE_VERSION`` when the base is champion), tenant -> store name (tenants with an adapter only)."""
    versions: dict[str, str] = {}
    names: dict[str, str] = {}
    for i, tenant in enumerate(tenants):
        folder = champions.get(tenant)
        if folder is None:
            versions[tenant] = BASE_VERSION
            continue
        name = f"champion-{i}"
        store.create(name, _champion_candidate(Path(folder), name), init_dir=Path(folder))
        names[tenant] = name
        versions[tenant] = f"{name}-{round_id}"
        engine.load(name, versions[tenant], Path(folder))
    return versions, names


def _champion_candidate(folder: Path, name: str) -> CandidateConfig:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    targets = cfg["target_modules"]
    return CandidateConfig(
        name=name,
        lora_rank=cfg["r"],
        lora_alpha=cfg["lora_alpha"],
        target_modules=sorted(targets) if isinstance(targets, list) else [targets],
        start="fresh",
    )
