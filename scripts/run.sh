#!/usr/bin/env bash
# The two README commands: `scripts/run.sh demo` and `scripts/run.sh test`.
# Both set everything up first (scripts/setup.sh is idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# GiB of KV cache per engine. The tests' engines need well under 2, and each
# start zero-fills the whole cache, so they get 2 (tests/conftest.py).
case "${1:-demo}" in
  demo) shift || true; export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
        exec .venv/bin/python examples/offline_generate.py "$@" ;;
  test) shift || true; exec .venv/bin/python -m pytest -q "$@" ;;
  *) echo "usage: scripts/run.sh demo|test [args]" >&2; exit 2 ;;
esac
