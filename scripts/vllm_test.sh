#!/usr/bin/env bash
# Builds the Python package into vLLM's environment (scripts/vllm_env.sh) and runs the tests that
# need vLLM (python/tests/test_vllm_*.py) there, on SmolLM2 converted for vLLM (scripts/vllm_model.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
env=$(scripts/vllm_env.sh)
"$env/bin/python" -m pip install --quiet --no-build-isolation . >&2
export INFKV_VLLM_MODEL INFKV_TEXT
INFKV_VLLM_MODEL=$(scripts/vllm_model.sh | tail -n 1)
INFKV_TEXT=$(scripts/kjv.sh | tail -n 1)
cd python   # outside the repository root: the installed package is tested, not python/infkv
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} exec "$env/bin/pytest" -q -rs -p no:cacheprovider tests/test_vllm_*.py "$@"
