"""The reward model from users' feedback: examples and pairs from a snapshot, its
loss against a reference formula, its held-out metrics, and learning a planted
preference on the tiny model."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from trainer.adapters.store import make_store
from trainer.model.base import load_base
from trainer.model.logprobs import common_prefix_length
from trainer.config import CandidateConfig, ModelConfig, RewardModelConfig, RewardTerm, RLConfig
from trainer.errors import DataError, RewardError, TrainerConfigError
from trainer.data import feedback_data, prompts_from_table
from trainer.reward_model.model import (
    HEAD_FILE,
    TokenisedFeedback,
    auc_by_signal,
    create_reward_model,
    evaluate_reward_model,
    expected_calibration_error,
    reward_loss,
    roc_auc,
    tokenise_feedback,
    train_reward_model,
)
from trainer.rewards import build_reward
from trainer.round import run_round
from trainer.types import Prompt, RewardModelReport
from trainer.data import snapshot_table, split_snapshot
from trainer.types import RoundSpec
from trainer.data import round_inputs


def _row(i: int, prompt: str, completion: str | None, reward: float | None) -> Prompt:
    return Prompt(
        prompt_id=f"t{i:03d}",
        messages=[{"role": "user", "content": prompt}],
        logged_completion=completion,
        logged_reward=reward,
    )


def test_feedback_rows_give_examples_pairs_and_correction_pairs() -> None:
    rows = [
        _row(0, "2+2?", "4", 1.0),
        _row(1, "2+2?", "5", -1.0),
        _row(2, "2+2?", "four", 0.5),  # 2 up, 1 down: 2 pairs
        _row(3, "3+3?", "6", 1.0),  # one label only: no pair
        _row(4, "4+4?", "9", None),  # no feedback: no example
        _row(5, "5+5?", "11", 0.0),  # reward 0 -> thumbs down
        _row(6, "6+6?", "12", float("nan")),  # not a finite reward: skipped
    ]
    table = snapshot_table(rows)
    data = feedback_data(prompts_from_table(table))  # no correction column: read the same way
    assert [(e.trace_id, e.label) for e in data.examples] == [
        ("t000", True),
        ("t001", False),
        ("t002", True),
        ("t003", True),
        ("t005", False),
    ]
    assert [(p.chosen, p.rejected, p.source) for p in data.pairs] == [("4", "5", "feedback"), ("four", "5", "feedback")]
    assert (data.positives, data.negatives) == (3, 2)

    corrections = pa.array([None, "4", None, "6", "8", "", None], type=pa.string())
    data = feedback_data(prompts_from_table(table.append_column("correction", corrections)))
    by_source = [(p.chosen, p.rejected) for p in data.pairs if p.source == "correction"]
    # row 1: "4" over "5"; row 3: same text as its completion (no pair); row 4: a correction without a rating still counts
    assert by_source == [("4", "5"), ("8", "9")]
    assert len(data.examples) == 5


def test_loss_equals_the_reference_formula() -> None:
    scores = torch.tensor([1.5, -0.5, 0.2], dtype=torch.float64)
    labels = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    chosen = torch.tensor([0.3, 2.0], dtype=torch.float64)
    rejected = torch.tensor([0.1, -1.0], dtype=torch.float64)
    coef = 0.01
    loss, metrics = reward_loss(scores, labels, chosen, rejected, coef)

    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    bce = (
        -sum(y * math.log(sig(s)) + (1 - y) * math.log(1 - sig(s)) for s, y in zip(scores.tolist(), labels.tolist()))
        / 3
    )
    bt = (
        -sum(math.log(sig(c - r)) for c, r in zip(chosen.tolist(), rejected.tolist())) / 2
    )  # Bradley-Terry / TRL RewardTrainer
    center = (
        sum((c + r) ** 2 for c, r in zip(chosen.tolist(), rejected.tolist())) / 2
    )  # TRL's center_rewards_coefficient term
    assert loss.item() == pytest.approx(bce + bt + coef * center, rel=1e-12)
    assert metrics["reward_model/bce"] == pytest.approx(bce) and metrics["reward_model/bt"] == pytest.approx(bt)
    # no pairs: BCE only; no labelled rows: pairs only
    assert reward_loss(scores, labels, chosen[:0], rejected[:0], coef)[0].item() == pytest.approx(bce)
    assert reward_loss(scores[:0], labels[:0], chosen, rejected, 0.0)[0].item() == pytest.approx(bt)


def test_auc_and_calibration_by_hand() -> None:
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == pytest.approx(0.75)
    assert roc_auc([1.0, 1.0], [True, False]) == pytest.approx(0.5)  # a tie counts half
    assert math.isnan(roc_auc([1.0, 2.0], [True, True]))
    # sigmoid(0) = 0.5 for all: one bin, mean label 0.25 -> ECE 0.25
    assert expected_calibration_error([0.0] * 4, [True, False, False, False]) == pytest.approx(0.25)


def test_auc_per_signal_by_hand() -> None:
    """Each signal's rows, and where they hold one label only, every row of the other label."""
    scores = [0.9, 0.2, 0.8, 0.1, 0.3, 0.7, 0.6]
    labels = [True, False, True, False, False, True, True]
    sources = ["thumbs", "thumbs", "continued", "rephrased", "thumbs+edited", "continued", ""]
    by_signal = auc_by_signal(scores, labels, sources)
    # thumbs: its own rows (0.9 up; 0.2, 0.3 down) -> 1.0
    assert by_signal["thumbs"] == pytest.approx(1.0)
    # continued (always up: 0.8, 0.7) against every down row (0.2, 0.1, 0.3) -> 1.0
    assert by_signal["continued"] == pytest.approx(1.0)
    # rephrased (always down: 0.1) against every up row (0.9, 0.8, 0.7, 0.6) -> 1.0
    assert by_signal["rephrased"] == pytest.approx(1.0)
    # edited (down 0.3) against every up row: all above -> 1.0; an unknown source counts for none
    assert set(by_signal) == {"thumbs", "continued", "rephrased", "edited"}
    # a continued row the model scores below a down-voted one pulls only continued's AUC down
    worse = auc_by_signal([0.9, 0.2, 0.1, 0.3], [True, False, True, False], ["thumbs", "thumbs", "continued", "x"])
    assert worse["thumbs"] == pytest.approx(1.0) and worse["continued"] == pytest.approx(0.0)
    assert auc_by_signal([0.5], [True], ["continued"]) == {}  # no other label anywhere: undefined, absent


def test_per_signal_aucs_reach_the_round_metrics() -> None:
    """The snapshot's reward_source travels to each labelled example, and the report names a metric per signal."""
    rows = [_row(i, f"q{i}", f"a{i}", 1.0 if i % 2 else -1.0) for i in range(4)]
    table = snapshot_table(rows).append_column(
        "reward_source", pa.array(["thumbs", "continued", "rephrased", "thumbs"], type=pa.string())
    )
    examples = feedback_data(prompts_from_table(table)).examples
    assert [e.source for e in examples] == ["thumbs", "continued", "rephrased", "thumbs"]
    report = RewardModelReport(0.7, 0.6, 0.5, 0.1, None, 4, 0, auc_by_signal={"continued": 0.75})
    assert report.as_metrics()["reward_model/auc/continued"] == 0.75
    assert report.as_metrics("reward_model/champion")["reward_model/champion/auc/continued"] == 0.75


def test_reward_model_term_reads_the_rounds_score() -> None:
    mix = build_reward([RewardTerm(fn="reward_model"), RewardTerm(fn="format", weight=0.5)])
    assert mix([], "42", {"reward_model_score": 0.0}) == pytest.approx(0.5 + 0.5)
    raw = build_reward([RewardTerm(fn="reward_model", kwargs={"probability": False})])
    assert raw([], "x", {"reward_model_score": -2.5}) == pytest.approx(-2.5)
    with pytest.raises(RewardError, match="reward model's score"):
        mix([], "42", {})
    assert not build_reward([RewardTerm(fn="reward_model")], skip_logged=True)  # held-out answers have no score


def _planted(n: int, seed: int = 0) -> list[Prompt]:
    """Completions that end with the marker word ' banana' get a thumbs-up, the others a thumbs-down.

    The marker is the last word: the tiny model's attention is random, so the
    last token's hidden state is where a marker reliably shows.
    """
    rng = random.Random(seed)
    words = "apple river stone cloud green seven table music light paper".split()
    rows = []
    for i in range(n):
        good = i % 2 == 0
        text = " ".join(rng.sample(words, 3) + (["banana"] if good else [rng.choice(words)]))
        rows.append(_row(i, f"Tell me about item {i}.", text, 1.0 if good else -1.0))
    return rows


def test_reward_adapter_learns_a_planted_preference(tiny_model: Path, tmp_path: Path) -> None:
    rows = _planted(64)
    # every fourth down-voted answer was corrected by its user into a liked one: correction pairs
    corrections = [
        " ".join(r.logged_completion.split()[:-1] + ["banana"]) if i % 8 == 1 else None for i, r in enumerate(rows)
    ]
    table = snapshot_table(rows).append_column("correction", pa.array(corrections, type=pa.string()))
    train, heldout = split_snapshot(table, 0.25)
    base = load_base(ModelConfig(name=str(tiny_model)))
    store = make_store("offload", base)
    cfg = RewardModelConfig(steps=12, batch_size=16, learning_rate=5e-3)
    model = create_reward_model(base, store, cfg, None)
    held = tokenise_feedback(base, feedback_data(prompts_from_table(heldout)))
    before = evaluate_reward_model(model, held, 0.9, 200)
    history = train_reward_model(model, tokenise_feedback(base, feedback_data(prompts_from_table(train))), cfg)
    after = evaluate_reward_model(model, held, 0.9, 200)
    assert after.auc >= 0.9 and after.heldout_examples == 16, (before, after)
    assert after.accuracy > before.accuracy and history[-1]["reward_model/loss"] < history[0]["reward_model/loss"]
    assert after.heldout_pairs == 2 and after.pair_accuracy == 1.0 and all(h["reward_model/bt"] > 0 for h in history)
    assert (
        after.as_metrics()["reward_model/auc"] == after.auc and after.as_metrics()["reward_model/pair_accuracy"] == 1.0
    )

    # saved beside its adapter, the head reloads to the same scores (the continual start)
    folder = model.save(tmp_path / "rm")
    assert (folder / HEAD_FILE).is_file() and (folder / "adapter_model.safetensors").is_file()
    again = create_reward_model(base, store, cfg, folder, name="rm-again")
    ids = [e[0] for e in held.examples], [e[1] for e in held.examples]
    assert again.score(*ids) == pytest.approx(model.score(*ids), abs=1e-5)
    store.close()


def test_round_on_reward_model_without_enough_feedback_fails_or_skips_with_a_reason(
    tiny_model: Path, tmp_path: Path
) -> None:
    rows = _planted(8)
    rows = [
        Prompt(
            r.prompt_id,
            r.messages,
            {"reference_answer": "1"},
            r.logged_completion,
            logged_reward=r.logged_reward if i < 3 else None,
        )
        for i, r in enumerate(rows)
    ]
    train, heldout = split_snapshot(snapshot_table(rows), 0.25)
    cand = CandidateConfig(
        name="rm-user", reward=[RewardTerm(fn="reward_model"), RewardTerm(fn="format")], start="fresh"
    )
    rl = RLConfig(rollout={"engine": "hf"}, gate={"eval_prompts": 2})
    # format is verifiable on every row, so evaluation has prompts; the reward model has 3 labelled rows
    with pytest.raises(DataError, match=r"no reward model could be trained.*3 rows with feedback.*min_examples = 8"):
        run_round(RoundSpec(ModelConfig(name=str(tiny_model)), (cand,), rl), round_inputs(train, heldout), tmp_path)
    # beside a candidate that needs no reward model, the one that does sits the round out, with the reason
    # and so does one whose data_filter matches no row of the window
    fmt = CandidateConfig(name="fmt", reward=[RewardTerm(fn="format")], start="fresh")
    picky = CandidateConfig(name="picky", reward=[RewardTerm(fn="format")], data_filter="nowhere", start="fresh")
    mixed = run_round(
        RoundSpec(ModelConfig(name=str(tiny_model)), (cand, picky, fmt), rl.model_copy(update={"steps_per_round": 1})),
        round_inputs(train, heldout),
        tmp_path / "mixed",
    )
    assert [c.name for c in mixed.candidates] == ["fmt"] and mixed.reward_model is None
    assert list(mixed.skipped) == ["rm-user", "picky"]
    assert "3 rows with feedback" in mixed.skipped["rm-user"] and "min_examples = 8" in mixed.skipped["rm-user"]
    assert mixed.skipped["picky"].startswith("no training prompts after the data_filter")
    assert not (tmp_path / "mixed" / "rm-user").exists() and not (tmp_path / "mixed" / "picky").exists()
    # with enough feedback, but the one candidate that learns from the reward model has no prompts: none is trained
    rated = [replace(r, logged_reward=1.0 if i % 2 else -1.0) for i, r in enumerate(_planted(24))]
    train_r, heldout_r = split_snapshot(snapshot_table(rated), 0.25)
    picky_rm = cand.model_copy(update={"data_filter": "nowhere"})
    alone = run_round(
        RoundSpec(ModelConfig(name=str(tiny_model)), (picky_rm, fmt), rl.model_copy(update={"steps_per_round": 1})),
        round_inputs(train_r, heldout_r),
        tmp_path / "alone",
    )
    assert list(alone.skipped) == ["rm-user"] and alone.skipped["rm-user"].startswith("no training prompts")
    assert alone.reward_model is None and alone.metrics.get("time/reward_model_s", 0.0) == 0.0
    assert not [k for k in alone.metrics if k.startswith("reward_model/")]
    assert not (tmp_path / "alone" / "reward-model").exists()
    # a gate that ranks by the reward model could promote nothing: refused before any model work, as before
    on_rm = rl.model_copy(update={"gate": rl.gate.model_copy(update={"metric": "reward_model"})})
    with pytest.raises(DataError, match=r"the gate ranks candidates by the reward model.*3 rows with feedback"):
        run_round(
            RoundSpec(ModelConfig(name=str(tiny_model)), (cand, fmt), on_rm),
            round_inputs(train, heldout),
            tmp_path / "g",
        )
    assert not (tmp_path / "g" / "fmt").exists()
    # the candidate left starves too (KTO with no rated row): the refusal names the one that sat out
    unrated = [replace(r, logged_reward=None) for r in rows]
    train_u, heldout_u = split_snapshot(snapshot_table(unrated), 0.25)
    kto = CandidateConfig(name="kto", algorithm="kto", reward=[RewardTerm(fn="logged")], start="fresh")
    with pytest.raises(DataError, match=r"offline candidates \['kto'\].*sat this round out: rm-user: no reward model"):
        run_round(
            RoundSpec(ModelConfig(name=str(tiny_model)), (cand, kto), rl),
            round_inputs(train_u, heldout_u),
            tmp_path / "k",
        )
    with pytest.raises(TrainerConfigError, match="enabled = false"):
        run_round(
            RoundSpec(
                ModelConfig(name=str(tiny_model)),
                (cand,),
                rl.model_copy(update={"reward_model": RewardModelConfig(enabled=False)}),
            ),
            round_inputs(train, heldout),
            tmp_path,
        )
    offline = CandidateConfig(
        name="off", algorithm="offline_is", reward=[RewardTerm(fn="logged"), RewardTerm(fn="reward_model")]
    )
    with pytest.raises(TrainerConfigError, match="only grpo / ppo_clip"):
        run_round(RoundSpec(ModelConfig(name=str(tiny_model)), (offline,), rl), round_inputs(train, heldout), tmp_path)
    assert not (tmp_path / "rm-user").exists()  # refused before any work


def test_logged_token_ids_outside_the_vocabulary_do_not_crash_reward_training(tiny_model: Path) -> None:
    """A trace's ``completion_token_ids`` come from traffic (any int32 passes ingest): ids the base cannot
    embed (negative, >= vocab) must not stop the round; the row is read from its completion text instead."""
    base = load_base(ModelConfig(name=str(tiny_model)))
    vocab = base.model.get_input_embeddings().num_embeddings
    rows = [
        Prompt(
            prompt_id=f"t{i}",
            messages=[{"role": "user", "content": "2+2?"}],
            logged_completion=text,
            logged_token_ids=ids,
            logged_reward=reward,
        )
        for i, (text, ids, reward) in enumerate(
            [("4", [vocab + 5], 1.0), ("5", [-3, 7], -1.0), ("four", [2**31 - 1], 1.0), ("x", [1, 2], -1.0)]
        )
    ]
    data = tokenise_feedback(base, feedback_data(rows))
    text_ids = list(base.tokenizer("4", add_special_tokens=False)["input_ids"])
    assert data.examples[0][1] == text_ids  # out-of-vocabulary logged ids: the text's tokens
    assert data.examples[3][1] == [1, 2]  # valid logged ids are kept
    assert all(0 <= t < vocab for e in data.examples for t in e[1])
    assert all(0 <= t < vocab for p in data.pairs for seq in p[1:] for t in seq)
    store = make_store("offload", base)
    cfg = RewardModelConfig(steps=1, batch_size=4)
    model = create_reward_model(base, store, cfg, None)
    history = train_reward_model(model, data, cfg)
    assert len(history) == 1 and math.isfinite(history[0]["reward_model/loss"])
    store.close()


def test_a_reward_model_that_scores_nan_has_no_auc() -> None:
    """Found by a red-team pass: NaN scores ranked above every number, so a head that scored NaN on exactly the
    up-voted rows had AUC 1.0 (and a bootstrap lower bound above 0.5: the round would use it); undefined now."""
    from trainer.reward_model.model import auc_lower_bound

    nan = float("nan")
    scores, labels = [nan, 0.1, nan, 0.2, nan, 0.3], [True, False, True, False, True, False]
    assert math.isnan(roc_auc(scores, labels))
    assert math.isnan(auc_lower_bound(scores, labels, 0.95, 50))
    assert auc_by_signal(scores, labels, ["thumbs"] * 6) == {}


def _float32_reward_model(tiny_model: Path, rows: int) -> tuple:
    """A fresh reward model on the tiny base in float32, and ``rows`` planted feedback rows as token ids."""
    base = load_base(ModelConfig(name=str(tiny_model)))
    base.model.float()
    store = make_store("offload", base)
    model = create_reward_model(base, store, RewardModelConfig(), None)
    return base, store, model, tokenise_feedback(base, feedback_data(_planted(rows)))


def test_scoring_runs_each_distinct_sequence_once_and_returns_every_rows_score(tiny_model: Path) -> None:
    """Held-out feedback repeats sequences (a pair's answers are rows of their own; users get the same answer):
    each distinct (prompt, answer) is scored once, in batches of similar length, and every row gets the score it
    gets alone. A logged answer ending in EOS is the same sequence as its text."""
    base, store, model, data = _float32_reward_model(tiny_model, 12)
    prompts, answers = [e[0] for e in data.examples], [e[1] for e in data.examples]
    eos = base.tokenizer.eos_token_id
    rows_p = prompts + prompts[:5] + prompts[3:4]  # 18 rows, 12 distinct
    rows_c = answers + answers[:5] + [list(answers[3]) + [eos]]
    alone = [model.forward([p], [c]).item() for p, c in zip(rows_p, rows_c)]
    seen: list[int] = []
    forward = model.forward

    def counted(p, c):  # noqa: ANN001
        seen.extend(len(a) + len(b) for a, b in zip(p, c))
        return forward(p, c)

    model.forward = counted  # type: ignore[method-assign]
    model.batch_size = 4
    scores = model.score(rows_p, rows_c)
    model.forward = forward  # type: ignore[method-assign]
    assert scores == pytest.approx(alone, abs=1e-4) and len(scores) == 18
    assert len(seen) == 12 and seen == sorted(seen)  # once each, shortest first
    assert scores[12:17] == scores[:5] and scores[17] == scores[3]
    # a preference pair whose answers are one sequence (but for a trailing EOS) is a tie: half right
    tie = (prompts[3], answers[3], list(answers[3]) + [eos])
    report = evaluate_reward_model(model, TokenisedFeedback(data.examples, (tie,)), 0.9, 20)
    assert report.pair_accuracy == 0.5 and report.heldout_pairs == 1
    store.close()


def _forward_backward(base, store, model, prompts, answers):  # noqa: ANN001, ANN202
    """A function that runs the reward model's forward and a backward of a fixed weighting of its scores on the
    rows, and returns the scores, the adapter's and head's gradients and the backbone forwards' input shapes."""
    optimizer = store.activate(model.name)
    params = [p for group in optimizer.param_groups for p in group["params"]] + list(model.head.parameters())
    backbone = getattr(base.model.get_base_model(), base.model.get_base_model().base_model_prefix)

    def run() -> tuple[list[float], list[torch.Tensor], list[tuple[int, int]]]:
        seen: list[tuple[int, int]] = []
        hook = backbone.register_forward_pre_hook(
            lambda _m, _a, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
        )
        try:
            for p in params:
                p.grad = None
            scores = model.forward(prompts, answers)
            (scores * torch.linspace(-1.0, 1.0, len(prompts))).sum().backward()
        finally:
            hook.remove()
        return scores.tolist(), [p.grad.clone() for p in params], seen

    return run


def _assert_same_pass(shared: tuple, plain: tuple) -> None:
    """Scores within 1e-5 and gradients within float32 rounding of the plain pass's, which moved something."""
    assert shared[0] == pytest.approx(plain[0], abs=1e-5)
    assert any(g.abs().max() > 1e-6 for g in plain[1])
    for got, want in zip(shared[1], plain[1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_rows_sharing_prompts_run_each_prompt_once_with_the_plain_passs_scores_and_gradients(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four answers to each of eight prompts of different lengths (a pair's two answers share their prompt; users
    ask the same question): the shared opening runs once, each prompt's rest once, then every row's answer, and
    the scores and the adapter's and head's gradients are the plain pass's (float32)."""
    base, store, model, data = _float32_reward_model(tiny_model, 32)
    answers = [e[1] for e in data.examples]
    asked = [base.prompt_ids([{"role": "user", "content": f"Tell me about item {7**i}."}]) for i in range(8)]
    prompts = [asked[b % 8] for b in range(32)]
    assert len({len(p) for p in asked}) > 2  # left pads between the opening and a short prompt's rest
    opening = common_prefix_length(asked)
    run = _forward_backward(base, store, model, prompts, answers)
    shared = run()
    longest_answer = max(len(model._strip(c)) for c in answers)
    assert shared[2] == [(1, opening), (8, max(map(len, asked)) - opening), (32, longest_answer)]
    monkeypatch.setattr("trainer.reward_model.model.MIN_PREFIX_TOKENS_SAVED", 10**9)
    monkeypatch.setattr("trainer.reward_model.model.worth_sharing", lambda seqs: 0)
    plain = run()
    assert plain[2] == [(32, max(len(p) + len(model._strip(c)) for p, c in zip(prompts, answers)))]
    _assert_same_pass(shared, plain)
    store.close()


@pytest.mark.parametrize("window", [8, 110, 1024])
def test_a_sliding_window_reward_model_shares_an_opening_only_when_every_row_fits_its_window(
    smollm2_model: Path, tmp_path: Path, window: int
) -> None:
    """Gemma 3's local layers mask by distance between cache slots: the left pads between the shared opening and a
    short prompt's rest would push opening tokens out of a window they are inside of. At 110 every row fits (the longest has 101 tokens) but the longest prompt (100) and the longest
    answer (20) do not together: each prompt runs once without the opening stage, as at 8 (a hostile pass
    measured a score off by 0.21 when the rule read the longest row). At 1024 the opening runs once. All give the
    plain pass's scores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.model import store as model_store

    tiny = model_store.build_tiny(model_store.TinyArchitecture.GEMMA3, tmp_path / "tiny", tokenizer_from=smollm2_model)
    lm = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32)
    lm.config.sliding_window = window
    lm.save_pretrained(tmp_path / "model")
    AutoTokenizer.from_pretrained(tiny.path).save_pretrained(tmp_path / "model")
    base = load_base(ModelConfig(name=str(tmp_path / "model"), dtype="float32", device="cpu"))
    store = make_store("offload", base)
    model = create_reward_model(base, store, RewardModelConfig(), None)
    g = torch.Generator().manual_seed(5)
    system = torch.randint(10, 400, (40,), generator=g).tolist()
    asked = [system + torch.randint(10, 400, (n,), generator=g).tolist() for n in (60, 1, 2)]
    prompts = [asked[b % 3] for b in range(24)]
    answers = [torch.randint(10, 400, (20 if b == 1 else 1,), generator=g).tolist() for b in range(24)]
    backbone = getattr(base.model.get_base_model(), base.model.get_base_model().base_model_prefix)
    seen: list[tuple[int, int]] = []
    hook = backbone.register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    store.activate(model.name)
    with torch.no_grad():
        shared = model.forward(prompts, answers).tolist()
        shapes = list(seen)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("trainer.reward_model.model.MIN_PREFIX_TOKENS_SAVED", 10**9)
            patch.setattr("trainer.reward_model.model.worth_sharing", lambda seqs: 0)
            plain = model.forward(prompts, answers).tolist()
    hook.remove()
    assert seen[len(shapes) :] == [(24, 101)]  # rows of up to 100 + 1 tokens, whole
    assert shared == pytest.approx(plain, abs=1e-5)
    # each prompt once: inside a window of 1024 after the 40-token opening; else whole, left-padded
    assert shapes == ([(1, 40), (3, 60), (24, 20)] if window == 1024 else [(3, 100), (24, 20)])
    store.close()


def test_a_step_of_long_rows_trains_in_chunks_with_the_same_update(tiny_model: Path) -> None:
    """Rows near max_seq_len made one step's forward/backward hold every row's activations (24 rows of ~1,000
    tokens took 19.7 GB and the kernel killed the service): above ``chunk_tokens`` a step scores its rows in
    chunks, and the update is the unchunked one."""
    rows = _planted(24)
    data = tokenise_feedback(load_base(ModelConfig(name=str(tiny_model))), feedback_data(rows))
    trained = {}
    for budget in (1_000_000, 40):  # one pass; chunks of a few rows
        base = load_base(ModelConfig(name=str(tiny_model)))
        base.model.float()
        store = make_store("offload", base)
        cfg = RewardModelConfig(steps=3, batch_size=6, learning_rate=5e-3, chunk_tokens=budget)
        model = create_reward_model(base, store, cfg, None)
        sizes: list[int] = []
        forward = model.forward

        def recorded(p, c, forward=forward, sizes=sizes):  # noqa: ANN001
            sizes.append(len(p) * max(len(a) + len(model._strip(b)) for a, b in zip(p, c)))
            return forward(p, c)

        ids = [e[0] for e in data.examples], [e[1] for e in data.examples]
        initial = model.score(*ids)
        model.forward = recorded  # type: ignore[method-assign]
        history = train_reward_model(model, data, cfg)
        model.forward = forward  # type: ignore[method-assign]
        trained[budget] = (history, initial, model.score(*ids), sizes)
        store.close()
    (whole, initial, whole_scores, whole_sizes), (chunked, _, chunked_scores, chunked_sizes) = (
        trained[1_000_000],
        trained[40],
    )
    longest = max(len(e[0]) + len(e[1]) for e in data.examples)
    assert len(whole_sizes) == 3 and max(whole_sizes) > 40  # one forward a step, above the small budget
    assert len(chunked_sizes) > 2 * 3 * 2 and max(chunked_sizes) <= max(40, longest)  # no-grad + grad per chunk
    assert [h["reward_model/loss"] for h in chunked] == pytest.approx([h["reward_model/loss"] for h in whole], abs=1e-5)
    assert whole_scores != pytest.approx(initial, abs=1e-3)  # the steps moved the scores
    assert chunked_scores == pytest.approx(whole_scores, abs=1e-4)  # ... and the chunked steps moved them the same


def test_rows_sharing_a_prefix_run_it_once_with_the_plain_passs_scores_and_gradients(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row of a step opens with the chat template's system turn: it runs once as one row, the rest of every
    row after it, and the scores and the adapter's and head's gradients are the plain pass's (float32)."""
    base, store, model, data = _float32_reward_model(tiny_model, 10)
    prompts, answers = [e[0] for e in data.examples], [e[1] for e in data.examples]
    shared_tokens = common_prefix_length([list(p) + list(c) for p, c in zip(prompts, answers)])
    assert shared_tokens >= 10  # the template's system turn and the user turn's opening
    run = _forward_backward(base, store, model, prompts, answers)
    shared = run()
    longest = max(len(p) + len(model._strip(c)) for p, c in zip(prompts, answers))
    assert shared[2] == [(1, shared_tokens), (10, longest - shared_tokens)]  # the prefix once, then every row's rest
    monkeypatch.setattr("trainer.reward_model.model.worth_sharing", lambda seqs: 0)
    plain = run()
    assert plain[2] == [(10, longest)]
    _assert_same_pass(shared, plain)
    store.close()
