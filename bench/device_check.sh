#!/usr/bin/env bash
# The trainer's GPU check: the CUDA code paths that CI (CPU only) never runs.
#   1. the adapter-store and loss tests on CUDA (pinned host buffers,
#      non_blocking copies, interleaved == alone on the GPU);
#   2. bench/adapter_swap.py at three model shapes (swap cost of the offload
#      store vs keeping every candidate on the device).
# Usage, from the repo root on a CUDA machine with torch, transformers, peft,
# pydantic and pytest importable:
#   bash bench/device_check.sh TINY_MODEL_DIR OUT_DIR
# TINY_MODEL_DIR is ~/.cache/hourglass/models/tiny-random-llama copied over
# (built by the test suite here); it also serves as the tokenizer.
set -uo pipefail
tiny=$(realpath "$1"); out=$2
mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 HOURGLASS_TINY_MODEL=$tiny PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name(0))" | tee "$out/env.log"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
status=0
python3 -m pytest -q -p no:cacheprovider --noconftest -p bench.device_fixtures \
  tests/trainer/test_adapter_store.py tests/trainer/test_losses.py tests/trainer/test_gate.py 2>&1 | tee "$out/pytest.log" || status=1
swap() {  # shape, then extra arguments
  python3 bench/adapter_swap.py --shape "$1" --device cuda --dtype bfloat16 --tokenizer "$tiny" \
    --batch 16 --prompt-len 256 --completion-len 256 "${@:2}" 2>&1 | tee "$out/swap-$1.log" || status=1
}
swap smollm2
swap 1b
swap 8b --rounds 1 --repeats 1
exit $status
