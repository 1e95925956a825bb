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
# Prompts: Spec-Bench minus its MT-bench and math_reasoning categories (those are
# the evaluation prompts), GSM8K test (minus Spec-Bench's), HumanEval, and
# synthetic MT-bench-style instructions (2,643 prompts, 3,110 turns); greedy
# responses of <= 128 tokens.
# INIT_FROM=HEAD_DIR goes on training a saved head instead of starting from
# scratch (the shipped head was made that way: see its specplug_eagle3.json).
# Runs niced, on THREADS torch threads (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
THREADS=${THREADS:-2}
DATA=${EAGLE3_DATA:-$HOME/.cache/vllm_specplug/eagle3-data/smollm2-v2}
HEAD=${EAGLE3_HEAD:-vllm_specplug/eagle3/heads/smollm2-135m-instruct}
TARGET=$($PY -c "from vllm_specplug.models.reference import reference_model_path as p; print(p())")
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export OMP_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=false
stage=${1:-all}

if [[ $stage == all || $stage == data ]]; then
  nice -n 10 $PY -m vllm_specplug.eagle3.cli generate-data \
    --target "$TARGET" --out "$DATA" \
    --sources spec_bench,gsm8k,humaneval,synthetic \
    --max-new-tokens 128 --max-prompt-tokens 768 --shard-size 64 --threads "$THREADS"
fi

if [[ $stage == all || $stage == train ]]; then
  nice -n 10 $PY -m vllm_specplug.eagle3.cli train \
    --data "$DATA" --out "$HEAD" \
    --draft-vocab-size 12288 --ttt-steps 4 --loss kl \
    --epochs "${EPOCHS:-4}" --batch-size 16 --lr 6e-4 --warmup 20 \
    --eval-samples 48 --save-every 50 --log-every 10 --head-dtype float16 \
    --threads "$THREADS" ${MAX_MINUTES:+--max-minutes $MAX_MINUTES} \
    ${INIT_FROM:+--init-from "$INIT_FROM"}
fi
