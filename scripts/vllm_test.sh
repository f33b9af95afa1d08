#!/usr/bin/env bash
# Builds the Python package into vLLM's environment (scripts/vllm_env.sh) and runs the tests that
# need vLLM (python/tests/test_vllm_*.py) there, on SmolLM2 converted for vLLM (scripts/vllm_model.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/vllm_common.sh
export INFKV_VLLM_MODEL=$model INFKV_TEXT=$text
cd python   # outside the repository root: the installed package is tested, not python/infkv
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} exec "$env/bin/pytest" -q -rs -p no:cacheprovider tests/test_vllm_*.py "$@"
