"""Why would one side learn less? One GRPO step of the K candidates of ``bench/multilora.py``, on the same real
rollouts, in every variant that differs between the sides, without a server: a controlled comparison.

The rollouts: the round's first-step prompts (``draw_prompts``, seed ``--seed``), G samples each at
temperature 1 from a float32 copy of the base (what vLLM on CPU runs: float32), their float32
log-probabilities as the behaviour policy, scored with the bench's reward (first_number_answer + 0.5
format) and given GRPO advantages. At the first step every candidate's LoRA is zero (B = 0), so all
K candidates see these same rollouts in the round too.

Variants (each candidate from the same start weights, one AdamW step on the same batch):

- ``sequential``: ``update_step`` on the bf16 base, prompt sharing on: what (a) does.
- ``sequential_whole``: the same without prompt sharing (every row whole).
- ``one_pass``: ``train_one_pass``, all K in one forward/backward: what (b) does.
- ``ratio_one``: sequential, behaviour log-probs = the bf16 trainer's own, so the importance ratio is 1
  and the clip never acts: what TRL does without vLLM.
- ``float32``: sequential on a float32 base (the numerics yardstick).

Per variant it prints the PPO-clip statistics of the importance ratio (bf16 trainer vs float32
behaviour), the cosine of each candidate's weight update with the ``float32`` one's, and the
first-order improvement of the surrogate, ``token mean of A x (log pi_after - log pi_before)`` on the
batch (how much of the batch's signal the step took), averaged over candidates.

    python bench/learning_probe.py                       # the round preset's first step, K = 8
    python bench/learning_probe.py --prompts 4 --group 6 --max-new-tokens 12 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import writer  # noqa: E402
from bench.multilora import EVAL_REWARD, candidates, tables  # noqa: E402
from trainer.model import store as model_store  # noqa: E402
from trainer.adapters.store import make_store  # noqa: E402
from trainer.model.base import ResidentBase, load_base  # noqa: E402
from trainer.config import GateConfig, ModelConfig, RLConfig, RolloutConfig, UpdateConfig  # noqa: E402
from trainer.algorithms.losses import group_advantages, masked_mean  # noqa: E402
from trainer.multi_lora.one_pass import train_one_pass  # noqa: E402
from trainer.plan import draw_prompts  # noqa: E402
from trainer.rewards import build_reward  # noqa: E402
from trainer.types import Sample  # noqa: E402
from trainer.data import prompts_from_table  # noqa: E402
from trainer.algorithms.batch import Batch  # noqa: E402
from trainer.algorithms.ppo import rollout_batch  # noqa: E402
from trainer.algorithms.update import update_step  # noqa: E402

VARIANTS = ("float32", "sequential", "sequential_whole", "one_pass", "ratio_one")


def sample_rollouts(ref: ResidentBase, prompt_ids: list[list[int]], group: int, max_new: int, seed: int):
    """G samples per prompt from the float32 base (temperature 1), with their float32 log-probs."""
    torch.manual_seed(seed)
    groups = []
    for p, ids in enumerate(prompt_ids):
        x = torch.tensor([ids] * group)
        with torch.no_grad(), ref.reference():
            out = ref.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new,
                pad_token_id=ref.tokenizer.pad_token_id,
            )
        completions = []
        for row in out[:, len(ids) :].tolist():
            eos = ref.tokenizer.eos_token_id
            completions.append(row[: row.index(eos) + 1] if eos in row else row)
        with torch.no_grad(), ref.reference():
            lp_BT, _ = ref.completion_logprobs([ids] * group, completions)
        groups.append(
            [
                Sample(
                    f"p{p}",
                    str(ref.tokenizer.decode(c, skip_special_tokens=True)),
                    tuple(c),
                    tuple(lp_BT[g, : len(c)].tolist()),
                    "base",
                )
                for g, c in enumerate(completions)
            ]
        )
    return groups


def surrogate_gain(base: ResidentBase, store, name: str, batch: Batch, before_BT: torch.Tensor) -> float:
    """Token mean of A x (log pi_after - log pi_before) over the batch, with ``name`` live."""
    store.activate(name)
    base.share_prompts = True
    with torch.no_grad():
        after_BT, mask_BT = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
    adv_B1 = torch.tensor(batch.advantages).unsqueeze(1)
    return float(masked_mean(adv_B1 * (after_BT.float() - before_BT), mask_BT))


def flat_delta(store, name: str, start: dict[str, torch.Tensor]) -> torch.Tensor:
    snap = store.snapshot(name)
    keys = sorted(k for k in start if k.startswith("weight/"))
    return torch.cat([(snap[k].float() - start[k].float()).flatten() for k in keys])


def probe(args: argparse.Namespace, bf16: ResidentBase, fp32: ResidentBase, seed: int) -> dict:
    rl = RLConfig(
        steps_per_round=1,
        prompts_per_step=args.prompts,
        rollout=RolloutConfig(group_size=args.group, max_new_tokens=args.max_new_tokens),
        seed=seed,
        gate=GateConfig(reward=EVAL_REWARD),
        update=UpdateConfig(adapters_per_pass=args.k),
    )
    cands = candidates(args.k)
    mix = build_reward(cands[0].reward)
    train, _ = tables(argparse.Namespace(eval_prompts=32))
    pool = [p for p in prompts_from_table(train) if mix.accepts(p.metadata)]
    prompts = draw_prompts(pool, args.prompts, seed * 7919)
    ids = [bf16.chat_token_ids(p.messages) for p in prompts]
    groups = sample_rollouts(fp32, ids, args.group, args.max_new_tokens, seed)
    batch, m = rollout_batch(prompts, ids, groups, mix, group_advantages)
    with torch.no_grad(), bf16.reference():
        own_BT, mask_BT = bf16.completion_logprobs(batch.prompt_ids, batch.completion_ids)
    own_BT = own_BT.float()
    old_BT = torch.zeros_like(own_BT)
    for b, row in enumerate(batch.behaviour_logprobs):
        old_BT[b, : len(row)] = torch.tensor(row)
    log_ratio = (own_BT - old_BT)[mask_BT.bool()]
    adv_B1 = torch.tensor(batch.advantages).unsqueeze(1).expand_as(own_BT)[mask_BT.bool()]
    ratio = log_ratio.exp()
    zeroed = ((ratio > 1 + rl.update.clip_eps) & (adv_B1 > 0)) | ((ratio < 1 - rl.update.clip_eps) & (adv_B1 < 0))
    stats = {
        "tokens": int(mask_BT.sum()),
        "reward_mean": m["train/reward_mean"],
        "groups_with_signal": m["train/groups_with_signal"],
        "mean_abs_log_ratio": float(log_ratio.abs().mean()),
        "max_abs_log_ratio": float(log_ratio.abs().max()),
        "outside_clip": float(((ratio - 1).abs() > rl.update.clip_eps).float().mean()),
        "gradient_zeroed": float(zeroed.float().mean()),
    }
    ratio_one = Batch(
        batch.prompt_ids,
        batch.completion_ids,
        [own_BT[b, : len(c)].tolist() for b, c in enumerate(batch.completion_ids)],
        batch.advantages,
        batch.rewards,
        batch.versions,
    )
    stores = {"bf16": make_store("offload", bf16, seed), "fp32": make_store("offload", fp32, seed)}
    own = {v: [c.model_copy(update={"name": f"{v.replace('_', '-')}-{c.name}"}) for c in cands] for v in VARIANTS}
    result: dict = {"stats": stats, "cos": {}, "gain": {}}
    with tempfile.TemporaryDirectory() as tmp:
        starts = {}
        for i, c in enumerate(cands):
            first = own["sequential"][i]
            stores["bf16"].create(first.name, first)
            folder = stores["bf16"].save(first.name, Path(tmp) / c.name)
            starts[c.name] = stores["bf16"].snapshot(first.name)
            for v in VARIANTS:
                if v != "sequential":
                    stores["fp32" if v == "float32" else "bf16"].create(own[v][i].name, own[v][i], folder)
        for v in VARIANTS:
            base, store = (fp32, stores["fp32"]) if v == "float32" else (bf16, stores["bf16"])
            if v == "one_pass":
                train_one_pass(base, store, [(c, batch) for c in own[v]], rl)
                continue
            base.share_prompts = v != "sequential_whole"
            for c in own[v]:
                update_step(base, store.activate(c.name), c, rl, ratio_one if v == "ratio_one" else batch)
            base.share_prompts = True
        deltas = {
            v: [
                flat_delta(stores["fp32" if v == "float32" else "bf16"], c.name, starts[c0.name])
                for c, c0 in zip(own[v], cands)
            ]
            for v in VARIANTS
        }
        for v in VARIANTS:
            result["cos"][v] = statistics.fmean(
                float(torch.nn.functional.cosine_similarity(d, r, dim=0)) for d, r in zip(deltas[v], deltas["float32"])
            )
            # the gain is measured with the bf16 trainer for every variant (float32's update copied in)
            gains = []
            for c, c0 in zip(own[v], cands):
                name = c.name
                if v == "float32":
                    name = f"eval-{c.name}"
                    stores["bf16"].create(
                        name, c.model_copy(update={"name": name}), stores["fp32"].save(c.name, Path(tmp) / name)
                    )
                gains.append(surrogate_gain(bf16, stores["bf16"], name, batch, own_BT))
            result["gain"][v] = statistics.fmean(gains)
    for s in stores.values():
        for n in list(s.names()):
            s.delete(n)
        s.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    writer.add_arguments(parser)
    args = parser.parse_args()
    recorder = writer.Recorder("multilora", args)
    rows: list[list[str]] = []
    gains: dict[int, list[str]] = {}
    path = model_store.resolve(args.model, ModelConfig().cache_dir)
    bf16 = load_base(ModelConfig(name=str(path)))  # dtype auto: bf16 on this CPU
    fp32 = load_base(ModelConfig(name=str(path), dtype="float32"))
    print(
        f"trainer base {next(bf16.model.parameters()).dtype}; behaviour policy float32; K={args.k} "
        f"P={args.prompts} G={args.group} max_new_tokens={args.max_new_tokens}"
    )
    for seed in args.seeds:
        r = probe(args, bf16, fp32, seed)
        s = r["stats"]
        print(
            f"seed {seed}: {s['tokens']} tokens, reward {s['reward_mean']:.3f}, groups with signal "
            f"{s['groups_with_signal']:.2f}; log ratio bf16 trainer / float32 behaviour: mean |.| "
            f"{s['mean_abs_log_ratio']:.4f}, max {s['max_abs_log_ratio']:.3f}, outside the clip {s['outside_clip']:.2%}, "
            f"gradient zeroed by the clip {s['gradient_zeroed']:.2%}"
        )
        print("  cos(update, float32 update): " + ", ".join(f"{v} {r['cos'][v]:.3f}" for v in VARIANTS))
        print("  surrogate gain A x dlogp (x1e3): " + ", ".join(f"{v} {1e3 * r['gain'][v]:.3f}" for v in VARIANTS))
        gains[seed] = [f"{1e3 * r['gain'][v]:.2f}" for v in ("one_pass", "sequential", "ratio_one")]
        rows += [[str(seed), v, f"{r['cos'][v]:.3f}", f"{1e3 * r['gain'][v]:.2f}"] for v in VARIANTS]
        rows.append(
            [
                str(seed),
                "importance ratio (bf16 trainer / float32 behaviour)",
                "",
                f"mean abs log ratio "
                f"{s['mean_abs_log_ratio']:.4f}, outside the clip {s['outside_clip']:.2%}, gradient zeroed "
                f"{s['gradient_zeroed']:.2%}",
            ]
        )
    recorder.write(
        "learning-probe",
        title=f"learning probe: one GRPO step of K = {args.k} candidates, {args.prompts} prompts x G = {args.group}, "
        f"{args.max_new_tokens} new tokens, every variant on the same rollouts",
        columns=["seed", "variant", "cos(update, float32 update)", "surrogate gain x1e3"],
        rows=rows,
        result="surrogate gain x1e3, one_pass / sequential / ratio_one: "
        + "; ".join(f"seed {seed}: {' / '.join(gains[seed])}" for seed in gains),
    )


if __name__ == "__main__":
    main()
