#!/usr/bin/env bash
# Builds the Python package into the project's Python environment (scripts/python_env.sh) and runs
# its tests (python/tests, pytest) on the project's real model and text. Run by scripts/test.sh;
# extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
env=$(scripts/python_env.sh)
# nanobind and scikit-build-core are pinned in the environment: no isolated build environment
"$env/bin/python" -m pip install --quiet --no-build-isolation . >&2
export INFKV_MODEL INFKV_TEXT INFKV_REQUIRE_MODEL=1
INFKV_MODEL=$(scripts/model.sh)
INFKV_TEXT=$(scripts/kjv.sh)
cd python   # outside the repository root: the installed package is tested, not python/infkv
# -rs: every skip with its reason; the tests that need vLLM run in its environment (scripts/vllm_test.sh)
exec "$env/bin/pytest" -q -rs -p no:cacheprovider tests --ignore-glob='tests/test_vllm_*.py' "$@"
