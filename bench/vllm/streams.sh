#!/usr/bin/env bash
# Measures concurrent streams in vLLM's CPU engine with and without infkv's plugin (streams.py) and
# writes bench/results/vllm/{streams,capacity}_{full,infkv}.json with provenance. Run on an idle
# machine; about 45 minutes on 2 cores. `streams.sh capacity` (or `streams`) runs one part only.
# `streams.sh bf16`: the model and KV in bf16 (AMX kernels where the CPU has them), histories of
# 4,096 and 16,384 tokens (the second past SmolLM2's 8,192 trained positions: time and memory
# only, the answers are not read), decode tokens/s from vLLM's per-request token times
# (streams.py --method direct; settings of at most 16,384 prompt tokens three times), vLLM without the plugin
# beside the plugin's two modes (bench/results/vllm/streams_bf16_{full,infkv,plain}.json), then six
# 16K-token requests in 1 GiB of KV with and without the plugin (capacity_bf16_{full,infkv}.json);
# about 75 minutes (`streams.sh bf16-capacity`: the second part only). `streams.sh bf16-alternate`:
# one stream, full and infkv alternated in one engine (about 7 minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/vllm_common.sh
out=bench/results/vllm
mkdir -p "$out"
part=${1:-all}
if [ "$part" = bf16-alternate ]; then
  # One stream, full and infkv requests alternated in one engine, four times each: the ratio
  # without the drift between runs minutes apart (bench/results/vllm/streams_bf16_alternate.json).
  args="--mode both --streams 1 --history 4096,16384 --gen 64 --kv-gib 8 --dtype bfloat16 --positions 16896 --method direct --repeats 4"
  # shellcheck disable=SC2086
  (cd /tmp && OMP_NUM_THREADS=1 "$env/bin/python" "$OLDPWD/bench/vllm/streams.py" --model "$model" --text "$text" \
    $args --out "$OLDPWD/$out/streams_bf16_alternate.json")
  python3 scripts/provenance.py "$out/streams_bf16_alternate.json" "bench/vllm/streams.py $args"
  exit 0
fi
if [ "$part" = bf16 ] || [ "$part" = bf16-capacity ]; then
  for mode in full infkv plain; do
    [ "$part" = bf16-capacity ] && break
    args="--mode $mode --streams 1,4,16 --history 4096,16384 --gen 64 --kv-gib 8 --dtype bfloat16 --positions 16896 --method direct --repeats 3"
    # shellcheck disable=SC2086  # the arguments are words
    (cd /tmp && OMP_NUM_THREADS=1 "$env/bin/python" "$OLDPWD/bench/vllm/streams.py" --model "$model" --text "$text" \
      $args --out "$OLDPWD/$out/streams_bf16_$mode.json")
    python3 scripts/provenance.py "$out/streams_bf16_$mode.json" "bench/vllm/streams.py $args"
  done
  # 16K-token requests in a fixed KV space: how many run at once.
  for mode in full infkv; do
    args="--mode $mode --capacity --streams 6 --history 16384 --gen 128 --kv-gib 1 --dtype bfloat16 --positions 16896"
    # shellcheck disable=SC2086
    (cd /tmp && OMP_NUM_THREADS=1 "$env/bin/python" "$OLDPWD/bench/vllm/streams.py" --model "$model" --text "$text" \
      $args --out "$OLDPWD/$out/capacity_bf16_$mode.json")
    python3 scripts/provenance.py "$out/capacity_bf16_$mode.json" "bench/vllm/streams.py $args"
  done
  exit 0
fi
for mode in full infkv; do
  if [ "$part" != capacity ]; then
  cmd="bench/vllm/streams.py --mode $mode --streams 1,4,16 --history 4096 --gen 64 --kv-gib 4"
  (cd /tmp && OMP_NUM_THREADS=1 "$env/bin/python" "$OLDPWD/bench/vllm/streams.py" --model "$model" --text "$text" \
    --mode $mode --streams 1,4,16 --history 4096 --gen 64 --kv-gib 4 --out "$OLDPWD/$out/streams_$mode.json")
  python3 scripts/provenance.py "$out/streams_$mode.json" "$cmd"
  fi
  [ "$part" = streams ] && continue
  # Requests that decode long enough to be in the engine together: how many fit in 1 GiB of KV.
  cmd="bench/vllm/streams.py --mode $mode --capacity --streams 12 --history 4096 --gen 256 --kv-gib 1"
  (cd /tmp && OMP_NUM_THREADS=1 "$env/bin/python" "$OLDPWD/bench/vllm/streams.py" --model "$model" --text "$text" \
    --mode $mode --capacity --streams 12 --history 4096 --gen 256 --kv-gib 1 --out "$OLDPWD/$out/capacity_$mode.json")
  python3 scripts/provenance.py "$out/capacity_$mode.json" "$cmd"
done
