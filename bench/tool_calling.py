"""Can the served model call a tool at all? (issue #27, item 4: a tool-using scenario learned from users.)

Learning to use a tool from users' behaviour needs answers that call it: a round reinforces what the model
already does now and then, it does not invent a format it never emits. This probe measures, through a running
vLLM (``/v1/completions``, the prompt rendered with the chat template the service ships for tools,
``chatml-tools``: Hermes-style ``<tool_call>`` blocks), for two-digit multiplications with a ``calculate``
tool offered:

1. **spontaneous calls**: the share of sampled answers (temperature 0.7) holding a ``<tool_call>`` block whose
   JSON names ``calculate``, without and with a system prompt telling the model to use the tool;
2. **forced call, right arguments**: the answer is started for the model up to the call's
   ``"expression": "`` (what ``tool_choice`` ``required`` or a named tool makes vLLM do), and the share whose
   expression is the question's product is counted;
3. **the answer after the tool result**: the correct call and its result are in the conversation, and the
   share of greedy answers whose first number is the result (copying it back);
4. **the demo's user turn**: the calculator scenario's whole turn through vLLM's chat API
   (:meth:`pipeline.demo.traffic.Scenario.answer`: ``tool_choice`` naming the tool, the app running the call,
   the answer), greedy and sampled at the demo users' temperature 0.7, judged by the users' check. This needs
   the vLLM started with the tool parser (the demo's ``--scenario calculator`` starts it so).

The expression is run by the demo's calculator (:func:`pipeline.demo.traffic.calculate`).

    python bench/tool_calling.py [--vllm-url http://127.0.0.1:18000] [--model base] [--questions 16] [--samples 8]

A vLLM must be serving the base model: the demo's (``python -m pipeline.demo --keep-up``) or ``hourglass up``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import writer  # noqa: E402
from pipeline.demo.traffic import CALCULATE_TOOL, calculate, is_correct  # noqa: E402

SYSTEM = "You are a helpful assistant. For any arithmetic, call the calculate tool instead of computing yourself."


def calls_calculator(text: str) -> bool:
    """Whether an answer holds a ``<tool_call>`` block whose JSON names ``calculate`` (one pass over the text:
    no regular expression to backtrack on an unclosed block)."""
    for piece in text.split("<tool_call>")[1:]:
        end = piece.find("</tool_call>")
        if end < 0:
            continue
        try:
            call = json.loads(piece[:end])
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") == "calculate":
            return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-url", default="http://127.0.0.1:18000")
    parser.add_argument("--model", default="base", help="the served name of the model to probe")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="sampled answers per question")
    parser.add_argument("--seed", type=int, default=0)
    writer.add_arguments(parser)
    args = parser.parse_args()
    recorder = writer.Recorder("tool-calling", args)

    from transformers import AutoTokenizer

    from pipeline.cli.common import load
    from pipeline.cli.main import base_model_dir
    from trainer.templates import CHATML_TOOLS, template_path

    tokenizer = AutoTokenizer.from_pretrained(base_model_dir(load(Path("deploy/demo.toml"))))
    template = template_path(CHATML_TOOLS).read_text()  # type: ignore[union-attr]

    def render(messages: list[dict[str, Any]]) -> str:
        text = tokenizer.apply_chat_template(
            messages, tools=[CALCULATE_TOOL], chat_template=template, add_generation_prompt=True, tokenize=False
        )
        return str(text)

    def complete(prompt: str, n: int, temperature: float, max_tokens: int) -> list[str]:
        body = {"model": args.model, "prompt": prompt, "n": n, "temperature": temperature, "max_tokens": max_tokens}
        response = httpx.post(f"{args.vllm_url}/v1/completions", json=body, timeout=300)
        response.raise_for_status()
        return [c["text"] for c in response.json()["choices"]]

    rng = random.Random(args.seed)
    pairs = [(rng.randint(11, 99), rng.randint(11, 99)) for _ in range(args.questions)]
    spontaneous = {"no system prompt": 0, "system prompt: use the tool": 0}
    forced_right = copied = 0
    for a, b in pairs:
        question = {"role": "user", "content": f"What is {a} * {b}?"}
        for label, messages in (
            ("no system prompt", [question]),
            ("system prompt: use the tool", [{"role": "system", "content": SYSTEM}, question]),
        ):
            answers = complete(render(messages), args.samples, 0.7, 48)
            spontaneous[label] += sum(calls_calculator(t) for t in answers)
        opening = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "'
        for text in complete(render([question]) + opening, args.samples, 0.7, 16):
            forced_right += calculate(text.split('"', 1)[0]) == str(a * b)
        call = {
            "id": "call-0",
            "type": "function",
            "function": {"name": "calculate", "arguments": json.dumps({"expression": f"{a} * {b}"})},
        }
        after: list[dict[str, Any]] = [question, {"role": "assistant", "content": "", "tool_calls": [call]}]
        after.append({"role": "tool", "tool_call_id": "call-0", "content": str(a * b)})
        copied += is_correct(complete(render(after), 1, 0.0, 24)[0], str(a * b))

    from openai import OpenAI

    from pipeline.demo.traffic import CALCULATOR

    client = OpenAI(base_url=f"{args.vllm_url}/v1", api_key="none", max_retries=2, timeout=300)
    turn_right = {0.0: 0, 0.7: 0}
    for a, b in pairs:
        for temperature in turn_right:
            for _ in range(1 if temperature == 0.0 else args.samples):
                question = {"role": "user", "content": f"What is {a} * {b}?"}
                _, answer, _ = CALCULATOR.answer(client, args.model, [question], temperature=temperature)
                turn_right[temperature] += is_correct(answer, str(a * b))
    sampled = args.questions * args.samples
    rows = [
        [f"spontaneous `calculate` calls, {label}", f"{hits}/{sampled}", f"{hits / sampled:.1%}"]
        for label, hits in spontaneous.items()
    ]
    rows.append(
        [
            "call forced open, the expression is the product",
            f"{forced_right}/{sampled}",
            f"{forced_right / sampled:.1%}",
        ]
    )
    rows.append(
        [
            "greedy answer after the right tool result repeats it",
            f"{copied}/{args.questions}",
            f"{copied / args.questions:.1%}",
        ]
    )
    rows.append(
        [
            "the demo's user turn (named `tool_choice`), greedy: answer right",
            f"{turn_right[0.0]}/{args.questions}",
            f"{turn_right[0.0] / args.questions:.1%}",
        ]
    )
    rows.append(
        [
            "the demo's user turn, sampled at 0.7: answer right",
            f"{turn_right[0.7]}/{sampled}",
            f"{turn_right[0.7] / sampled:.1%}",
        ]
    )
    for row in rows:
        print(f"{row[0]}: {row[1]} ({row[2]})")
    recorder.write(
        args.model,
        title=f"`{args.model}` with the `chatml-tools` template, {args.questions} two-digit products, {args.samples} samples each",
        columns=["measure", "count", "share"],
        rows=rows,
        result=f"spontaneous calls {sum(spontaneous.values())}/{2 * sampled}",
    )


if __name__ == "__main__":
    main()
