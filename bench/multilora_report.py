"""What ``bench/multilora.py`` prints besides wall times: what each side learned, and (b)'s phases against
this machine's limits (:mod:`bench.limits`). Pure functions of the sides' reports, unit-tested."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.limits import DTYPE_BYTES, Limits, ModelShape, engine_bound, forward_flops, rate_line, train_flops
from pipeline.config import VLLM_MAX_NUM_SEQS_DEFAULT


@dataclass(frozen=True)
class Learned:
    """One side's learning: the base's evaluation reward, each candidate's after training, and each candidate's
    training reward per step."""

    base: float
    after: dict[str, float]
    train: dict[str, list[float]]

    @classmethod
    def from_reports(cls, reports: Sequence[Mapping[str, Any]]) -> Learned:
        """Merge per-process reports (``eval_base``, ``eval_reward``, ``train_reward``); the base is their mean."""
        return cls(
            base=statistics.fmean(r["eval_base"] for r in reports),
            after={n: v for r in reports for n, v in r["eval_reward"].items()},
            train={n: list(v) for r in reports for n, v in r["train_reward"].items()},
        )

    @property
    def mean_after(self) -> float:
        return _mean(self.after.values())

    @property
    def gain(self) -> float:
        return self.mean_after - self.base


def _mean(values: Any) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def _order(name: str) -> tuple[int, str]:
    digits = "".join(ch for ch in name if ch.isdigit())
    return (int(digits) if digits else 0, name)


def paired_difference(x: Mapping[str, float], y: Mapping[str, float]) -> tuple[float, float]:
    """Mean and standard error of ``x[c] - y[c]`` over the candidates both have (SE NaN below two)."""
    diffs = [x[n] - y[n] for n in x if n in y]
    if not diffs:
        return float("nan"), float("nan")
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return statistics.fmean(diffs), se


def learning_lines(sides: Mapping[str, Learned], eval_prompts: int, reference: str = "(b)") -> list[str]:
    """Evaluation reward base -> after per side, the per-candidate difference of each side against
    ``reference``, and the training reward of the first and last step."""

    def fmt(d: Mapping[str, float]) -> str:
        return "[" + ", ".join(f"{d[n]:.3f}" for n in sorted(d, key=_order)) + "]"

    lines = [
        f"eval reward (first_number_answer of greedy answers, {eval_prompts} held-out prompts), base -> mean after "
        "training (gain) [per candidate]: "
        + "; ".join(
            f"{label} {s.base:.3f} -> {s.mean_after:.3f} ({s.gain:+.3f}) {fmt(s.after)}" for label, s in sides.items()
        )
    ]
    if reference in sides and len(sides) > 1:
        ref = sides[reference]
        parts = []
        for label, s in sides.items():
            if label == reference:
                continue
            diff, se = paired_difference(s.after, ref.after)
            worst = max((abs(s.after[n] - ref.after[n]) for n in s.after if n in ref.after), default=float("nan"))
            parts.append(f"{label} - {reference} {diff:+.3f} ± {se:.3f} (largest |per-candidate| {worst:.3f})")
        lines.append("eval reward after training, per candidate, mean ± SE over candidates: " + "; ".join(parts))
    lines.append(
        "train reward (first_number_answer + 0.5 format), mean over candidates, first step -> last step: "
        + ", ".join(
            f"{label} {_mean(v[0] for v in s.train.values()):.3f} -> {_mean(v[-1] for v in s.train.values()):.3f}"
            for label, s in sides.items()
        )
    )
    return lines


@dataclass(frozen=True)
class RoundWork:
    """What (b)'s round computed, to turn its phase times into rates: K candidates, S steps of P prompts x G,
    E held-out prompts; the mean prompt length, the rollouts' completion tokens and the mean greedy answer length."""

    k: int
    steps: int
    prompts: int
    group: int
    eval_prompts: int
    prompt_tokens_mean: float
    rollout_tokens: float
    eval_length_mean: float
    lora_rank: int
    lora_targets: tuple[str, ...]
    share_prompts: bool = True

    @property
    def rows(self) -> int:
        return self.k * self.steps * self.prompts * self.group

    def trainer_tokens(self) -> float:
        """Tokens through the trainer's forward per pass over a round's rows: every completion token, and each
        prompt once per candidate and step (prompt sharing) or once per row."""
        prompt_runs = self.k * self.steps * self.prompts if self.share_prompts else self.rows
        return prompt_runs * self.prompt_tokens_mean + self.rollout_tokens

    def logit_positions(self) -> float:
        """Positions whose logits the trainer keeps: each completion token and the one before it."""
        return self.rollout_tokens + self.rows


def _engine_line(
    label: str,
    limits: Limits,
    shape: ModelShape,
    weight_bytes: float,
    seconds: float,
    *,
    sequences: float,
    prefill_tokens: float,
    decode_tokens: float,
    note: str,
    dtype: str,
) -> str:
    """One engine phase's decode rate against :func:`bench.limits.engine_bound` (the matmul rate of vLLM's
    ``dtype`` and the weight reads per step), with the bandwidth bound alone named beside it."""
    in_flight = int(min(sequences, VLLM_MAX_NUM_SEQS_DEFAULT))  # the benchmark's vLLM runs the service default
    bound = engine_bound(
        shape,
        prefill_tokens=prefill_tokens,
        decode_tokens=decode_tokens,
        in_flight=in_flight,
        weight_bytes_per_step=weight_bytes,
        bandwidth_B_s=limits.bandwidth_B_s,
        flop_s=limits.matmul_flop_s.get(dtype, float("nan")),
    )
    reads_only = decode_tokens / bound.reads_s if bound.reads_s > 0 else float("nan")
    return rate_line(
        label,
        decode_tokens / seconds,
        decode_tokens / bound.seconds,
        "tok/s",
        f"{decode_tokens:.0f} tokens after {prefill_tokens:.0f} prompt tokens in {seconds:.1f} s{note}; bound: "
        f"{bound.binding}, {bound.compute_s:.1f} s of {dtype} matmul vs {bound.reads_s:.1f} s reading "
        f"{weight_bytes / 1e9:.2f} GB a step with {in_flight} sequences in flight; the bandwidth alone would allow "
        f"{reads_only:,.0f} tok/s",
    )


def limit_lines(
    limits: Limits,
    shape: ModelShape,
    work: RoundWork,
    phase_s: Mapping[str, float],
    vllm_dtype: str = "float32",
) -> list[str]:
    """(b)'s engine phases against :func:`bench.limits.engine_bound` (vLLM computing in ``vllm_dtype``: float32
    on CPU unless asked, pipeline.stack.vllm_dtype) and its training phases against the matmul rates."""
    weights = (shape.params + work.k * shape.lora_params(work.lora_rank, work.lora_targets)) * DTYPE_BYTES[vllm_dtype]
    lines = [limits.line()]
    rollout_s = phase_s.get("time/rollout_s", 0.0)
    if rollout_s > 0:
        lines.append(
            _engine_line(
                "rollout decode",
                limits,
                shape,
                weights,
                rollout_s,
                sequences=work.k * work.prompts * work.group,
                prefill_tokens=work.k * work.steps * work.prompts * work.prompt_tokens_mean,  # n samples share one
                decode_tokens=work.rollout_tokens,
                note="",
                dtype=vllm_dtype,
            )
        )
    eval_s = phase_s.get("time/evaluate_s", 0.0)
    if eval_s > 0 and math.isfinite(work.eval_length_mean):
        answers = (work.k + 1) * work.eval_prompts  # the candidates and the base (champion), greedy
        lines.append(
            _engine_line(
                "evaluate decode",
                limits,
                shape,
                weights,
                eval_s,
                sequences=answers,
                prefill_tokens=answers * work.prompt_tokens_mean,  # every version prefills every prompt
                decode_tokens=answers * work.eval_length_mean,
                note=f" ({work.k + 1} versions; the KL pass included)",
                dtype=vllm_dtype,
            )
        )
    matmul = limits.matmul_flop_s
    for key, label, flops in (
        ("time/reference_s", "reference forward", forward_flops),
        ("time/forward_backward_s", "forward/backward", train_flops),
    ):
        seconds = phase_s.get(key, 0.0)
        if seconds <= 0:
            continue
        total = flops(shape, work.trainer_tokens(), work.logit_positions())
        rate = total / seconds
        lines.append(
            rate_line(
                label,
                rate / 1e9,
                matmul.get("bfloat16", float("nan")) / 1e9,
                "GFLOP/s",
                f"{total / 1e12:.2f} TFLOP in {seconds:.1f} s; bound: bf16 matmul; "
                f"{rate / matmul.get('float32', float('nan')):.1%} of the float32 one",
            )
        )
    return lines
