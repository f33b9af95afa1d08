#!/usr/bin/env bash
# Builds the Python package into vLLM's environment (scripts/vllm_env.sh) and runs the tests that
# need vLLM (python/tests/test_vllm_*.py) there. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
env=$(scripts/vllm_env.sh)
"$env/bin/python" -m pip install --quiet --no-build-isolation . >&2
cd python   # outside the repository root: the installed package is tested, not python/infkv
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} exec "$env/bin/pytest" -q -rs -p no:cacheprovider tests/test_vllm_*.py "$@"
