#!/usr/bin/env bash
# The single-turn side by side of docs/evaluation.md ("Beside OpenVINO GenAI and kvpress"): exports
# infkv-stream's version-2 needle questions (SmolLM2-135M, KJV, distance 2048, 12 per seed) and
# answers them with OpenVINO GenAI's cache eviction and kvpress's presses at each budget
# (scripts/peers_single_turn.py), one thread each. JSONs with scripts/provenance.py's record under
# OUT (default bench/results/peers); steps whose JSON exists are kept. ONLY=openvino or
# ONLY=kvpress runs one side (the two sides can run at once, a core each). LATER=1: kvpress's
# SnapKV and ChunkKV with the question later (the context compressed alone, the question decoded
# after it: infkv's streaming setting), OUT/kvpress_later_BUDGET.json.
#   scripts/peers.sh [OUT] [SEEDS (1-3)] [BUDGETS (1024,512)]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/peers}
seeds=${2:-1-3}
budgets=${3:-1024,512}
mkdir -p "$out"
model=$(scripts/model.sh | tail -n 1)
text=$(scripts/kjv.sh | tail -n 1)
cmake --build --preset release --target infkv_stream >&2
questions=${INFKV_CACHE:-$HOME/.cache/infkv}/peers
mkdir -p "$questions"
files=()
for ((s = ${seeds%-*}; s <= ${seeds#*-}; ++s)); do
  f=$questions/q_smollm2_2048_s$s.json
  [ -s "$f" ] || build/release/tools/infkv-stream --model "$model" --text "$text" --needle 2048 --needles 12 \
    --people 3 --needle-gap 128 --trials 12 --seed "$s" --export-questions "$f"
  files+=("$f")
done
step() {  # step NAME PYTHON ARGS...: writes OUT/NAME.json unless it exists
  local name=$1 python=$2; shift 2
  if [[ -s "$out/$name.json" ]]; then echo "peers: $out/$name.json exists, kept" >&2; return; fi
  echo "peers: $name (load $(cut -d' ' -f1 /proc/loadavg))" >&2
  # the GGUF first: a --model among ARGS (the OpenVINO IR) comes later and wins
  "$python" scripts/peers_single_turn.py "$1" --model "$model" "${@:2}" --questions "${files[@]}" \
    --out "$out/$name.json.tmp"
  python3 scripts/provenance.py "$out/$name.json.tmp" "scripts/peers.sh $* (seeds $seeds)"
  mv "$out/$name.json.tmp" "$out/$name.json"
}
if [ "${LATER:-0}" = 1 ]; then
  for b in ${budgets//,/ }; do
    step "kvpress_later_$b" "$(scripts/python_env.sh | tail -n 1)/bin/python" kvpress --budget "$b" \
      --presses snapkv,chunkkv --question-later
  done
  exit 0
fi
first=1
for b in ${budgets//,/ }; do
  if [ "${ONLY:-openvino}" = openvino ]; then
    # after the first budget: no full cache again, and (machine time) two modes
    more=(); [ $first = 1 ] || more=(--no-full --ov-modes NORM_SUM:w8,SUM:w32)
    step "openvino_$b" "$(scripts/openvino_env.sh | tail -n 1)/bin/python" openvino --budget "$b" "${more[@]}" \
      --model "$(scripts/openvino_model.sh | tail -n 1)"
  fi
  if [ "${ONLY:-kvpress}" = kvpress ]; then
    presses=full,snapkv,chunkkv,kvzip; [ $first = 1 ] || presses=snapkv,chunkkv
    step "kvpress_$b" "$(scripts/python_env.sh | tail -n 1)/bin/python" kvpress --budget "$b" --presses "$presses"
  fi
  first=0
done
