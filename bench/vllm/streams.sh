#!/usr/bin/env bash
# Measures concurrent streams in vLLM's CPU engine with and without infkv's plugin (streams.py) and
# writes bench/results/vllm/{streams,capacity}_{full,infkv}.json with provenance. Run on an idle
# machine; about 45 minutes on 2 cores. `streams.sh capacity` (or `streams`) runs one part only.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/vllm_common.sh
out=bench/results/vllm
mkdir -p "$out"
part=${1:-all}
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
