#!/usr/bin/env bash
# Runs every test: the C++ formatting check, the Release build (vectorised paths, llama.cpp
# adapter, tools and a short real-model streaming run included; the CUDA backend compiled for
# sm_80 and sm_90 when nvcc is installed, its GPU tests reported skipped without a device) and the
# ASan + UBSan build (portable paths, the CUDA backend's steps run on the host), every fuzz target
# briefly (clang, libFuzzer), then the Python package's tests (its parity with kvpress's presses on
# SmolLM2 included, and one question of the side by side with OpenVINO GenAI, whose small
# environment, scripts/openvino_env.sh, it creates). Installs what it needs first; llama.cpp is built once into ~/.cache/infkv
# (about 6 minutes on 2 cores) and the Python environment (torch, transformers, kvpress: about
# 3 GB, downloaded while the C++ builds) is created once there; the model and text are fetched
# once (SmolLM2 and Gemma 3 270M); all are reused afterwards. vLLM's environment (about 6 GB,
# scripts/vllm_env.sh) downloads alongside, for the tests that run infkv on vLLM's own kernels.
# Every skipped test is listed with its reason; under CI=true a skipped test fails the run unless
# it needs a GPU (CI's machines have none): the scripts install everything else.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/format.sh --check   # every C++ file follows .clang-format
jobs=$(nproc)
nvcc=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; } || true)
llama_prefix=$(scripts/llama_cpp.sh | tail -n 1)
# The Python and vLLM environments download while the C++ builds; stopped if this script stops first.
mkdir -p build
setsid scripts/python_env.sh > build/python_env.log 2>&1 &
python_env=$!   # its own process group: pip goes with it
setsid scripts/vllm_env.sh > build/vllm_env.log 2>&1 &
vllm_env=$!
trap 'kill -- -$python_env -$vllm_env 2>/dev/null || true' EXIT
scripts/model.sh >/dev/null   # the real model and text of the infkv-stream smoke test
scripts/model.sh gemma3 >/dev/null   # the text model of the mtmd check (a random projector is written for it)
scripts/kjv.sh >/dev/null
# Lists the tests ctest skipped in build/$1 with their reasons (log $2); under CI=true fails when
# one of them is not a GPU test (label gpu).
ctest_skips() {
  local dir=build/$1 log=$2 gpu skipped name bad=0
  skipped=$(sed -n 's/^[[:space:]]*[0-9]* - \(.*\) (Skipped)$/\1/p' "$log")
  [ -n "$skipped" ] || return 0
  gpu=$(ctest --test-dir "$dir" -N -L '^gpu$' | sed -n 's/^ *Test *#[0-9]*: //p')
  for name in $skipped; do
    echo "skipped: $name: $(ctest --test-dir "$dir" -R "^${name}\$" -V 2>&1 | grep -m1 -iE 'skipped:|no CUDA device' | sed 's/^[0-9]*: //')" >&2
    if [ "${CI:-}" = true ] && ! grep -qx "$name" <<< "$gpu"; then bad=1; fi
  done
  if [ "$bad" = 1 ]; then
    echo "infkv tests: under CI=true only GPU tests may be skipped (the scripts install everything else)" >&2
    return 1
  fi
}
for preset in release sanitize; do
  echo "== infkv tests: $preset (${SECONDS} s) ==" >&2
  extra=()
  [ "$preset" = release ] && extra=(-DINFKV_WITH_LLAMA_CPP=ON "-DCMAKE_PREFIX_PATH=$llama_prefix" -DINFKV_WITH_CUDA=ON)
  [ "$preset" = release ] && [ -n "$nvcc" ] && extra+=("-DCMAKE_CUDA_COMPILER=$nvcc")
  cmake --preset "$preset" "${extra[@]}" >/dev/null
  cmake --build --preset "$preset" -j "$jobs"
  ctest --preset "$preset" -j "$jobs" | tee "build/ctest_$preset.log"
  ctest_skips "$preset" "build/ctest_$preset.log"
done
echo "== infkv fuzz targets: 20 s each (${SECONDS} s) ==" >&2
scripts/fuzz.sh 20
echo "== infkv Python package (${SECONDS} s) ==" >&2
wait $python_env || { cat build/python_env.log >&2; exit 1; }
scripts/python_test.sh | tee build/pytest.log
# pytest's -rs lines: "SKIPPED [n] file:line: reason"; only the GPU test may skip under CI=true.
if [ "${CI:-}" = true ] && grep '^SKIPPED' build/pytest.log | grep -v 'no CUDA device'; then
  echo "infkv tests: under CI=true only GPU tests may be skipped (the scripts install everything else)" >&2
  exit 1
fi
echo "== infkv with vLLM's kernels (${SECONDS} s) ==" >&2
wait $vllm_env || { cat build/vllm_env.log >&2; exit 1; }
scripts/vllm_test.sh | tee build/vllm_pytest.log
if [ "${CI:-}" = true ] && grep '^SKIPPED' build/vllm_pytest.log; then
  echo "infkv tests: under CI=true no vLLM test may be skipped (the scripts install vLLM)" >&2
  exit 1
fi
echo "== infkv tests: all passed (${SECONDS} s) ==" >&2
