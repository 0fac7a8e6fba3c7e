#!/usr/bin/env bash
# The trainer's GPU check: the CUDA code paths that CI (CPU only) never runs.
#   1. the adapter-store, loss, bf16 and one-pass tests on CUDA (pinned host
#      buffers, non_blocking copies, interleaved == alone on the GPU, a bf16
#      base vs float32, the grouped-matmul one-pass gradients vs the loop);
#   2. bench/adapter_swap.py at three model shapes (swap cost of the offload
#      store vs keeping every candidate on the device);
#   3. bench/one_pass.py at the SmolLM2-135M and Llama-3.2-1B shapes (random
#      weights from their configs, bf16 base as model.dtype = auto picks it):
#      update time of K = 8 candidates, one forward/backward each vs one pass
#      for all, and the ratio sequential / one-pass.
# Usage, from the repo root on a CUDA machine with torch, transformers, peft,
# pydantic and pytest importable:
#   bash bench/device_check.sh TINY_MODEL_DIR OUT_DIR
# TINY_MODEL_DIR is ~/.cache/hourglass/models/tiny-random-llama copied over
# (built by the test suite here); it also serves as the tokenizer.
# QUICK=1 runs step 3 only, at small sizes (a check that the script runs; CPU
# too: DEVICE=cpu).
# The benchmarks write their sections (bench/writer.py) into copies of the docs
# pages under OUT_DIR/benchmarks/: copy those back over docs/benchmarks/.
set -uo pipefail
tiny=$(realpath "$1"); out=$2
device=${DEVICE:-cuda}
mkdir -p "$out/benchmarks"
cp docs/benchmarks/*.md "$out/benchmarks/"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 HOURGLASS_TINY_MODEL=$tiny PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')" | tee "$out/env.log"
status=0
onepass() {  # shape, then extra arguments
  python3 bench/one_pass.py --shape "$1" --device "$device" --dtype auto --tokenizer "$tiny" --k 8 --rank 16 --targets all \
    --report-dir "$out/benchmarks" "${@:2}" 2>&1 | tee "$out/one-pass-$1.log" || status=1
}
if [ "${QUICK:-0}" = 1 ]; then
  onepass tiny --batch 2 --prompt-len 8 --completion-len 8 --repeats 1
  exit $status
fi
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
python3 -m pytest -q -p no:cacheprovider --noconftest -p bench.device_fixtures \
  tests/trainer/test_adapter_store.py tests/trainer/test_losses.py tests/trainer/test_gate.py \
  tests/trainer/test_multi_lora.py tests/trainer/test_bf16.py -k "not round_in_one_pass and not vllm" -rs 2>&1 | tee "$out/pytest.log" || status=1
# one-pass chunks of 16,384 tokens (4 chunks of the 8 x 16 x 512 = 65,536; rl.update.chunk_tokens defaults to
# 2,048 for CPU hosts, which would cut this step into 32 launch-bound passes; unchunked, the 1B shape would hold
# an estimated ~2.5 MB of activations per token, more than the chip has)
onepass smollm2 --batch 16 --prompt-len 256 --completion-len 256 --chunk-tokens 16384
onepass 1b --batch 16 --prompt-len 256 --completion-len 256 --chunk-tokens 16384
swap() {  # shape, then extra arguments
  python3 bench/adapter_swap.py --shape "$1" --device cuda --dtype bfloat16 --tokenizer "$tiny" \
    --batch 16 --prompt-len 256 --completion-len 256 --report-dir "$out/benchmarks" "${@:2}" 2>&1 | tee "$out/swap-$1.log" || status=1
}
swap smollm2
swap 1b
swap 8b --rounds 1 --repeats 1
exit $status
