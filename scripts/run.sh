#!/usr/bin/env bash
# The two README commands: `scripts/run.sh demo` and `scripts/run.sh test`.
# Both set everything up first (scripts/setup.sh is idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
case "${1:-demo}" in
  demo) shift || true; exec .venv/bin/python examples/offline_generate.py "$@" ;;
  # Two test workers, one a core where there are two (SPECPLUG_TEST_WORKERS
  # overrides, 0: none): an engine computes on one core, so a single worker
  # leaves the other idle; each worker's engines hold several GiB.
  test) shift || true
        cores=$(nproc); workers=${SPECPLUG_TEST_WORKERS:-$(( cores < 2 ? cores : 2 ))}
        exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@" ;;
  *) echo "usage: scripts/run.sh demo|test [args]" >&2; exit 2 ;;
esac
